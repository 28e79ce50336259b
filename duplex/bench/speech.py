"""What the bench's callers say: eight requests to a voice assistant, spoken by espeak-ng.

The recordings ship with the package (duplex/bench/speech/*.wav), so a bench runs where
espeak-ng is not installed; as WAV, read by the standard library, so it runs where PyAV is not
installed either (a GPU host carrying only what the bench needs). Each runs from its first sounding sample to its last: a detector is
timed from the onset of the speech and a reply from its end, not from a synthesizer's lead-in
and trailing silence. `python -m duplex.bench.speech`
records them again (it needs espeak-ng).
"""

from __future__ import annotations

import functools
import io
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import soxr

# No digits: Whisper writes numbers as figures, and the transcription tests that speak these
# measure recognition, not number formatting.
TEXTS = (
    "the weather is nice today",
    "please book a table for dinner tonight",
    "what time does the train leave",
    "turn off the lights in the kitchen",
    "i would like to speak to a doctor",
    "can you help me find my phone",
    "the meeting has been moved to friday",
    "send the report to my manager",
)
VOICE = "en-us"
WORDS_PER_MINUTE = 150
RECORDINGS = Path(__file__).with_name("speech")
RECORDED_RATE = 24000
"""The recordings' rate: the Realtime API's, what the bench sends."""
ONSET_LEVEL = 1e-3
"""A sample above this (of full scale) is sound; espeak-ng's silence is exact zeros."""


def espeak(text: str, voice: str = VOICE,
           words_per_minute: int = WORDS_PER_MINUTE) -> tuple[np.ndarray, int]:
    """espeak-ng's speech for `text` as float32 mono, and its sample rate."""
    wav = subprocess.run(
        ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "--stdout", text],
        capture_output=True,
        check=True,
    ).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate = w.getframerate()
        pcm16 = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    return pcm16.astype(np.float32) / 32768, rate


def speech_only(pcm: np.ndarray) -> np.ndarray:
    """`pcm` from its first sounding sample to its last."""
    return pcm[onset(pcm) : len(pcm) - onset(pcm[::-1])]


def onset(pcm: np.ndarray) -> int:
    """The first sounding sample of `pcm` (its length if none sounds)."""
    loud = np.flatnonzero(np.abs(pcm) > ONSET_LEVEL)
    return int(loud[0]) if loud.size else len(pcm)


def _path(index: int) -> Path:
    return RECORDINGS / f"utterance{index}.wav"


def record(directory: Path = RECORDINGS) -> list[Path]:
    """Speak every text with espeak-ng and write its speech, silence cut, as 16-bit WAV."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(TEXTS):
        pcm, rate = espeak(text)
        pcm = soxr.resample(speech_only(pcm), rate, RECORDED_RATE)
        pcm16 = np.round(pcm * 32768).clip(-32768, 32767).astype(np.int16)
        path = directory / _path(i).name
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(RECORDED_RATE)
            w.writeframes(pcm16.astype("<i2").tobytes())
        paths.append(path)
    return paths


@functools.cache
def utterances(rate: int) -> tuple[np.ndarray, ...]:
    """The bundled recordings, in the order of TEXTS, as float32 at `rate`."""
    out = []
    for i in range(len(TEXTS)):
        with wave.open(str(_path(i)), "rb") as w:
            pcm16 = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        pcm = pcm16.astype(np.float32) / 32768
        if rate != RECORDED_RATE:
            pcm = soxr.resample(pcm, RECORDED_RATE, rate).astype(np.float32)
        out.append(pcm)
    return tuple(out)


@functools.cache
def lengths_s() -> tuple[float, ...]:
    """Seconds of each recording."""
    return tuple(len(pcm) / RECORDED_RATE for pcm in utterances(RECORDED_RATE))


if __name__ == "__main__":
    for p in record(Path(sys.argv[1]) if len(sys.argv) > 1 else RECORDINGS):
        print(p, p.stat().st_size, "bytes")
