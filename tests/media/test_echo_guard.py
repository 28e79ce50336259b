"""The echo guard alone: a reply played at a known playhead comes back into the microphone;
the speech detector (silero) must hear the user and not the echo, on a speakerphone and on a
headset (no echo path at all, where the canceller alone would eat the user's speech)."""

import numpy as np
import pytest
import soxr

from duplex.engine.vad import SileroVAD, VadStream
from duplex.media.echo import EchoGuard
from tests.transcription.fixtures import TEXTS, have_espeak, speak

pytestmark = pytest.mark.cpu_bound

RATE = 24000
FRAME = RATE // 50
LEAD = RATE // 5
CHUNK_S = 512 / 16000


@pytest.fixture(scope="module")
def voices():
    if not have_espeak():
        pytest.fail("espeak-ng is not installed (make test installs it)")
    reply, user = (soxr.resample(speak(TEXTS[i]), 16000, RATE).astype(np.float32) for i in (1, 5))
    return reply, user, SileroVAD()


def detected(voices, *, delay_ms=0, gain_db=None, user_at=None, strength=None):
    """Speech probabilities of what the guard passes on, 20 ms frames at real time; the reply
    starts playing at 0.5 s and is handed out 200 ms ahead of its playhead."""
    reply, user, vad = voices
    guard = EchoGuard(RATE, strength)
    total = max(len(reply), RATE + len(user)) + RATE
    mic = np.zeros(total, np.float32)
    if gain_db is not None:
        at = RATE // 2 + delay_ms * RATE // 1000
        echo = np.convolve(reply, [0.1, 0.2, 0.4, 0.2, 0.1], mode="same") * 10 ** (gain_db / 20)
        mic[at : at + len(echo)] += echo[: total - at]
    if user_at is not None:
        u = int(user_at * RATE)
        mic[u : u + len(user)] += user[: total - u]
    stream, probs, released = VadStream(), [], 0
    for i in range(0, total, FRAME):
        playhead = min(len(reply), max(0, i - RATE // 2))
        while released < min(len(reply), playhead + LEAD):
            guard.played(released, reply[released : released + FRAME])
            released += FRAME
        probs += vad.process([stream], [guard.clean(mic[i : i + FRAME], playhead)])[0]
    return np.array(probs) >= 0.5, guard


@pytest.mark.parametrize("delay_ms, gain_db, strength",
                         [(80, -6, None), (250, -20, "far_field")])
def test_the_echo_of_a_reply_is_no_speech(voices, delay_ms, gain_db, strength):
    speech, guard = detected(voices, delay_ms=delay_ms, gain_db=gain_db, strength=strength)
    assert not speech.any()
    assert guard.echo_frames > 0


def test_the_user_over_the_echo_and_on_a_headset_is_heard(voices):
    user_s = len(voices[1]) / RATE
    for gain_db in (-6, None):
        speech, _ = detected(voices, delay_ms=150, gain_db=gain_db, user_at=1.2)
        first = np.argmax(speech) * CHUNK_S
        heard = speech[int(1.2 / CHUNK_S) : int((1.2 + user_s) / CHUNK_S)].mean()
        assert 1.2 <= first < 1.2 + 0.35 and heard > 0.5, (gain_db, first, heard)


def test_the_canceller_runs_only_once_an_echo_is_seen(voices):
    _, headset = detected(voices)
    _, speaker = detected(voices, delay_ms=150, gain_db=-10)
    _, declared = detected(voices, strength="far_field")
    assert not headset.cancelling and headset.echo_frames == 0
    assert speaker.cancelling and speaker.echo_frames > 0
    assert declared.cancelling
