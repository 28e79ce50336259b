"""Resampling between the rates the transports and models use, with soxr."""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np
import soxr

SUPPORTED_RATES = (8000, 16000, 24000, 48000)


def _check_rate(rate: int) -> None:
    if rate not in SUPPORTED_RATES:
        raise ValueError(f"unsupported sample rate {rate}; supported: {SUPPORTED_RATES}")


def resample(samples: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """One-shot resampling of a whole signal."""
    _check_rate(in_rate)
    _check_rate(out_rate)
    samples = np.asarray(samples, dtype=np.float32)
    if in_rate == out_rate:
        return samples
    return soxr.resample(samples, in_rate, out_rate, quality="HQ").astype(np.float32)


HISTORY = 4800
"""Input samples (at least) a `Resampler.state` keeps: enough to re-prime the longest filter
("VHQ", 24 -> 16 kHz, which holds back up to ~1900 input samples) past its start-up."""


@dataclass(frozen=True)
class ResamplerState:
    """What a fresh `Resampler` needs to go on exactly where another left off: its last input
    samples (starting on a filter phase boundary), how many it was fed and how many it gave."""

    tail: np.ndarray
    fed: int
    emitted: int


class Resampler:
    """Streaming resampler: chunks in, chunks out, filter state carried between calls.

    `quality` "HQ" (the default) is for audio someone hears; its filter releases output in
    bursts tens of milliseconds apart. "QQ" releases every chunk at once, which is what speech
    detection wants. "VHQ" is a plain polyphase filter when downsampling: a fresh one fed the
    same input from any phase boundary computes the very same samples, so its `state` carries
    over exactly (the "HQ" filter works on blocks fixed from the stream's first sample, and a
    restart is off by a float rounding).
    """

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ") -> None:
        _check_rate(in_rate)
        _check_rate(out_rate)
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, "float32", quality)
        )
        self.quality = quality
        self.fed = 0
        self.emitted = 0
        self._skip = 0
        """Output still to discard after a `resume` (what the resampler resumed from gave)."""
        self._history: list[np.ndarray] = []

    def process(self, samples: np.ndarray, *, last: bool = False) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        self._remember(samples)
        out = self._stream.resample_chunk(samples, last=last)
        if self._skip:
            dropped = min(self._skip, len(out))
            self._skip -= dropped
            out = out[dropped:]
        self.emitted += len(out)
        return out

    def _remember(self, samples: np.ndarray) -> None:
        self.fed += len(samples)
        self._history.append(samples)
        kept = sum(len(h) for h in self._history)
        while len(self._history) > 1 and kept - len(self._history[0]) >= HISTORY + self._step:
            kept -= len(self._history.pop(0))

    @property
    def _step(self) -> int:
        """Input samples per filter phase cycle (3 for 24 -> 16 kHz)."""
        return self.in_rate // gcd(self.in_rate, self.out_rate)

    def state(self) -> ResamplerState:
        history = np.concatenate(self._history) if self._history else np.zeros(0, np.float32)
        keep = min(len(history), HISTORY)
        keep += (self.fed - keep) % self._step
        if keep > len(history):
            keep -= self._step
        return ResamplerState(history[len(history) - keep:].copy(), self.fed, self.emitted)

    @classmethod
    def resume(cls, in_rate: int, out_rate: int, quality: str,
               state: ResamplerState) -> Resampler:
        """A resampler that goes on from `state`: the output the original would give next."""
        r = cls(in_rate, out_rate, quality)
        if r._stream is None:
            r.fed = r.emitted = state.fed
            return r
        start = state.fed - len(state.tail)
        r._skip = state.emitted - start * out_rate // in_rate
        r.process(state.tail)
        r.fed, r.emitted = state.fed, state.emitted
        return r
