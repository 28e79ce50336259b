"""Batched speech detection gives each session what it would get alone, and what silero's own
streaming API gives."""

import numpy as np
import pytest
import torch

from duplex.bench.speech import utterances
from duplex.bench.synth import babble
from duplex.engine.vad import VAD_CHUNK, VAD_RATE, SileroVAD, VadService, VadStream
from tests.waiting import until


def signals():
    """Speech, silence, speech after silence and noise, of different lengths."""
    rng = np.random.default_rng(7)
    speech = babble(VAD_RATE * 2, rate=VAD_RATE, seed=1)
    late = np.concatenate([np.zeros(VAD_RATE // 2, np.float32),
                           babble(VAD_RATE, rate=VAD_RATE, seed=2)])
    return [speech, np.zeros(VAD_RATE, np.float32), late,
            (rng.standard_normal(VAD_RATE * 3 // 2) * 0.05).astype(np.float32)]


def alone(vad, signal, piece):
    stream, probs = VadStream(), []
    for start in range(0, len(signal), piece):
        probs += vad.process([stream], [signal[start:start + piece]])[0]
    return probs


def test_batched_probabilities_equal_each_stream_alone_whatever_the_framing():
    vad = SileroVAD()
    sigs = signals()
    expected = [alone(vad, s, VAD_CHUNK) for s in sigs]
    assert [len(p) for p in expected] == [len(s) // VAD_CHUNK for s in sigs]
    assert max(expected[0]) > 0.9 and max(expected[1]) < 0.1
    # All four together, fed in 20 ms network frames that do not line up with VAD chunks.
    streams, got = [VadStream() for _ in sigs], [[] for _ in sigs]
    frame = VAD_RATE // 50
    for start in range(0, max(len(s) for s in sigs), frame):
        out = vad.process(streams, [s[start:start + frame] for s in sigs])
        for i, probs in enumerate(out):
            got[i] += probs
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-5)


def test_one_stream_matches_silero_s_own_streaming_model():
    from silero_vad import load_silero_vad

    reference = load_silero_vad(onnx=False)
    vad = SileroVAD()
    speech = signals()[2]
    ours = alone(vad, speech, VAD_CHUNK)
    with torch.inference_mode():
        theirs = [float(reference(torch.from_numpy(speech[i:i + VAD_CHUNK]), VAD_RATE))
                  for i in range(0, len(speech) - VAD_CHUNK + 1, VAD_CHUNK)]
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_audio_of_a_session_mid_reply_skips_the_batching_wait_and_takes_the_rest_along():
    """A session whose reply is playing gets its probabilities at once (a barge-in pauses
    that reply); audio other sessions sent meanwhile rides in the same forward."""
    service = VadService(gather_s=600.0)
    try:
        got: dict[str, list[float]] = {}
        speech = babble(VAD_CHUNK * 2, rate=VAD_RATE, seed=3)
        service.submit(VadStream(), speech, lambda p: got.setdefault("idle", p))
        service.submit(VadStream(), speech, lambda p: got.setdefault("replying", p), urgent=True)
        until(lambda: len(got) == 2, "both sessions' probabilities, long before the wait ends")
        assert len(got["idle"].chunks) == len(got["replying"].chunks) == 2
        assert got["idle"] == got["replying"]
    finally:
        service.stop()


def test_audio_mid_reply_is_also_scored_ahead_of_the_chunk_grid():
    """Urgent audio that leaves part of a chunk pending gets its latest 512 samples scored
    too (`early`); other sessions' audio, and audio that ends on a chunk, get none."""
    service = VadService(gather_s=600.0)
    try:
        got: dict[str, object] = {}
        speech = babble(VAD_CHUNK * 2 + 320, rate=VAD_RATE, seed=3)
        service.submit(VadStream(), speech, lambda r: got.setdefault("idle", r))
        service.submit(VadStream(), speech, lambda r: got.setdefault("replying", r), urgent=True)
        service.submit(VadStream(), speech[:VAD_CHUNK], lambda r: got.setdefault("whole", r),
                       urgent=True)
        until(lambda: len(got) == 3, "the three sessions' probabilities")
        assert got["idle"].early is None and got["whole"].early is None
        assert got["replying"].early > 0.5 and got["replying"].chunks == got["idle"].chunks
    finally:
        service.stop()


@pytest.mark.cpu_bound
def test_scoring_ahead_finds_speech_sooner_and_changes_nothing_on_the_grid():
    vad = SileroVAD()
    frame = VAD_RATE // 50
    sooner = 0
    for pcm in utterances(VAD_RATE):
        signal = np.concatenate([np.zeros(VAD_RATE // 2 + 100, np.float32), pcm])
        stream, probs, first_early, first_grid = VadStream(), [], None, None
        for start in range(0, len(signal), frame):
            probs += vad.process([stream], [signal[start:start + frame]])[0]
            if first_grid is None and max(probs, default=0) >= 0.5:
                first_grid = start
            [early] = vad.early([stream])
            if first_early is None and early is not None and early >= 0.5:
                first_early = start
        # Scored ahead, never later than the grid; the grid's own scores are untouched.
        assert first_early <= first_grid
        sooner += first_early < first_grid
        np.testing.assert_allclose(probs, alone(vad, signal, VAD_CHUNK), atol=1e-5)
    assert sooner >= len(utterances(VAD_RATE)) // 2


def test_noise_clicks_and_tones_are_no_speech_scored_ahead_either():
    vad = SileroVAD()
    rng = np.random.default_rng(11)
    t = np.arange(VAD_RATE * 3) / VAD_RATE
    clicks = np.zeros(len(t), np.float32)
    for at in range(0, len(clicks), VAD_RATE // 4):
        clicks[at : at + 30] = rng.uniform(-0.8, 0.8, 30)
    frame = VAD_RATE // 50
    for signal in ((rng.standard_normal(len(t)) * 0.25).astype(np.float32), clicks,
                   (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)):
        stream, grid, ahead = VadStream(), [], []
        for start in range(0, len(signal), frame):
            grid += vad.process([stream], [signal[start:start + frame]])[0]
            ahead += [p for p in vad.early([stream]) if p is not None]
        assert max(grid) < 0.5 and max(ahead) < 0.5
