import socket

import pytest

from tests.transcription.fixtures import build_tiny_whisper, have_espeak, make_utterances


@pytest.fixture(scope="session")
def utterances(tmp_path_factory):
    if not have_espeak():
        pytest.fail("espeak-ng is not installed (make test installs it with apt-get)")
    return make_utterances(tmp_path_factory.mktemp("utterances"))


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory):
    return build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"))


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to reach another host fails the test that made it."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
