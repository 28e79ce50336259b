"""Resampling between the rates the transports and models use, with soxr."""

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


class Resampler:
    """Streaming resampler: chunks in, chunks out, filter state carried between calls.

    `quality` "HQ" (the default) is for audio someone hears or a model encodes; its filter
    releases output in bursts tens of milliseconds apart. "QQ" releases every chunk at once,
    which is what speech detection wants.
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

    def process(self, samples: np.ndarray, *, last: bool = False) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=last)
