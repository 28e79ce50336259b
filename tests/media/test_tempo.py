"""audio.output.speed's stage alone: FFmpeg's atempo streamed through PyAV, and a reply's words
kept with their sounds."""

from fractions import Fraction

import numpy as np
import pytest
import soxr

from duplex.media.tempo import ReplyTempo, Tempo
from tests.transcription.fixtures import TEXTS, have_espeak, speak

RATE = 24000
TONE = (0.3 * np.sin(2 * np.pi * 440 * np.arange(2 * RATE) / RATE)).astype(np.float32)


def streamed(tempo: Tempo, pcm: np.ndarray, sizes: list[int]) -> np.ndarray:
    out, at, k = [], 0, 0
    while at < len(pcm):
        n = sizes[k % len(sizes)]
        out.append(tempo.process(pcm[at : at + n]))
        at, k = at + n, k + 1
    return np.concatenate([*out, tempo.finish()])


def dominant_hz(pcm: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(len(pcm))))
    return float(np.argmax(spectrum)) * RATE / len(pcm)


def median_f0(pcm: np.ndarray) -> float:
    """The voice's pitch: the median autocorrelation peak (70-400 Hz) of its loud 40 ms frames."""
    n, found = RATE // 25, []
    loud = 0.3 * np.max(np.abs(pcm))
    for at in range(0, len(pcm) - n, n // 2):
        frame = pcm[at : at + n] - np.mean(pcm[at : at + n])
        if np.max(np.abs(frame)) < loud:
            continue
        corr = np.correlate(frame, frame, "full")[n - 1 :]
        low, high = RATE // 400, RATE // 70
        found.append(RATE / (low + int(np.argmax(corr[low:high]))))
    return float(np.median(found))


@pytest.mark.parametrize("speed", [Fraction(3, 2), Fraction(1, 4), Fraction(4, 5)])
def test_streamed_in_any_chunks_it_is_the_whole_signal_at_once(speed):
    # The filter's state carries over every boundary: no seam, whatever the chunking.
    whole = streamed(Tempo(RATE, speed), TONE, [len(TONE)])
    assert np.array_equal(streamed(Tempo(RATE, speed), TONE, [480, 1920, 7, 3001, 1]), whole)
    assert len(whole) == pytest.approx(len(TONE) / speed, rel=0.01)
    assert dominant_hz(whole) == pytest.approx(440, rel=0.01)


@pytest.mark.parametrize("speed", [Fraction(3, 2), Fraction(1, 4)])
def test_speech_keeps_its_pitch(speed):
    if not have_espeak():
        pytest.fail("espeak-ng is not installed (make test installs it)")
    voice = soxr.resample(speak(TEXTS[1]), 16000, RATE).astype(np.float32)
    faster = streamed(Tempo(RATE, speed), voice, [1920])
    assert len(faster) == pytest.approx(len(voice) / speed, rel=0.02)
    assert median_f0(faster) == pytest.approx(median_f0(voice), rel=0.03)


def test_words_move_with_their_sounds():
    reply = ReplyTempo(RATE)
    reply.start(1.5)
    pieces = []
    for k in range(25):
        pieces += reply.process(TONE[k * 1920 : (k + 1) * 1920], f"w{k} ")
    pieces += reply.finish(np.zeros(0, np.float32))
    starts, at = {}, 0
    for pcm, text in pieces:
        for word in text.split():
            starts[word] = at
        at += len(pcm)
    # Each word starts where its sound does in the listener's time: its place / 1.5.
    assert starts == {f"w{k}": k * 1280 for k in range(25)}
    assert at == pytest.approx(25 * 1280, rel=0.01)


def test_speed_one_passes_audio_through_and_a_cut_drops_what_the_filter_holds():
    reply = ReplyTempo(RATE)
    reply.start(1.0)
    chunk = TONE[:1920]
    [(pcm, text)] = reply.process(chunk, "w ")
    assert pcm is chunk and text == "w "
    reply.start(1.5)
    for k in range(5):
        reply.process(TONE[k * 1920 : (k + 1) * 1920], f"w{k} ")
    # A barge-in: neither the filter's held audio nor a word waiting for it comes out later.
    reply.reset()
    assert [(len(p), t) for p, t in reply.finish(np.zeros(0, np.float32))] == [(0, "")]
