"""The recordings the bench's callers say: espeak-ng's speech for the fixture texts, silence cut,
and speech to the detector from their first chunks."""

from __future__ import annotations

import numpy as np
import pytest
import soxr

from duplex.bench.speech import RECORDED_RATE, TEXTS, espeak, onset, speech_only, utterances
from duplex.engine.vad import SileroVAD, VadStream
from duplex.media.rates import VAD_CHUNK, VAD_RATE
from tests.transcription.fixtures import have_espeak


def test_each_recording_is_espeak_saying_its_text_without_its_silence():
    if not have_espeak():
        pytest.fail("espeak-ng is not installed (make test installs it with apt-get)")
    recorded = utterances(RECORDED_RATE)
    assert len(recorded) == len(TEXTS)
    for text, pcm in zip(TEXTS, recorded, strict=True):
        spoken, rate = espeak(text)
        spoken = soxr.resample(speech_only(spoken), rate, RECORDED_RATE)
        # Lead-in and trailing silence are cut: sound within a millisecond of either end.
        assert onset(pcm) <= RECORDED_RATE // 1000 and onset(pcm[::-1]) <= RECORDED_RATE // 1000
        assert len(pcm) == pytest.approx(len(spoken), abs=RECORDED_RATE // 100)
        n = min(len(pcm), len(spoken))
        similarity = np.dot(pcm[:n], spoken[:n]) / np.linalg.norm(pcm[:n]) / np.linalg.norm(spoken[:n])
        assert similarity > 0.99, text


def test_the_detector_hears_each_recording_as_speech_from_its_first_chunks():
    vad = SileroVAD()
    for text, pcm in zip(TEXTS, utterances(VAD_RATE), strict=True):
        stream = VadStream()
        lead = np.zeros(VAD_RATE // 2, np.float32)
        probs = vad.process([stream], [np.concatenate([lead, pcm])])[0]
        first = next(i for i, p in enumerate(probs) if p >= 0.5)
        # The bench times pauses from the onset: its speech must be speech within ~120 ms.
        assert 0 < (first + 1) * VAD_CHUNK - len(lead) <= VAD_RATE * 120 // 1000, text
