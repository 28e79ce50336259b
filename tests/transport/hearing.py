"""Whether a listener heard a whole reply: the parts it played (between the breaks a pause left)
each line up with the reply heard uninterrupted, in order, with nothing of it left out and
nothing played twice, and it sounded as long."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from duplex.bench.playout import Playout

SOUNDING = 0.01
"""A 10 ms window louder than this (RMS, of full scale: -40 dBFS) is sound."""


def align(part: np.ndarray, reference: np.ndarray) -> tuple[float, int]:
    """The best normalised correlation of `part` inside `reference`, and where it starts there.
    By FFT: a direct sum over every lag takes seconds for a few seconds of audio."""
    a = reference.astype(np.float64) - reference.mean()
    b = part.astype(np.float64) - part.mean()
    n = len(b)
    if n > len(a):
        a = np.pad(a, (0, n - len(a)))
    size = len(a) + n
    corr = np.fft.irfft(np.fft.rfft(a, size) * np.conj(np.fft.rfft(b, size)), size)[: len(a) - n + 1]
    power = np.concatenate([[0.0], np.cumsum(a * a)])
    energy = np.sqrt(np.maximum(power[n:] - power[:-n], 0.0) * float(b @ b))
    scores = corr / np.maximum(energy, 1e-9)
    lag = int(np.argmax(scores))
    return float(scores[lag]), lag


def sounding_s(pcm: np.ndarray, rate: int) -> float:
    n = rate // 100
    windows = pcm[: len(pcm) // n * n].reshape(-1, n)
    return float(np.count_nonzero(np.sqrt((windows**2).mean(axis=1)) > SOUNDING)) / 100


def trimmed(pcm: np.ndarray) -> np.ndarray:
    """Without the silence at either end (a held track's, a paused reply's)."""
    loud = np.flatnonzero(np.abs(pcm) > SOUNDING)
    return pcm[loud[0] : loud[-1] + 1] if loud.size else pcm[:0]


@dataclass(frozen=True)
class Hearing:
    correlations: tuple[float, ...]
    """Of each part with the reply, where it lines up best."""
    spans: tuple[tuple[int, int], ...]
    """Where each part lies in the reply (samples)."""
    sounding_s: float
    reference_sounding_s: float
    rate: int

    @property
    def repeated_s(self) -> float:
        """The most any part went back over the one before it."""
        overlaps = [a_end - b_start for (_, a_end), (b_start, _) in pairwise(self.spans)]
        return max([0, *overlaps]) / self.rate

    @property
    def in_order(self) -> bool:
        return all(a[0] < b[0] for a, b in pairwise(self.spans))


def played_parts(playout: Playout, tag) -> list[np.ndarray]:
    """What a listener played of reply `tag`, cut at its breaks (a pause)."""
    cuts, done, end = [], 0, None
    for s in playout.segments:
        if s.tag != tag:
            continue
        if end is not None and s.start > end:
            cuts.append(done)
        done, end = done + len(s.pcm), s.end
    return np.split(playout.heard(tag), cuts)


def split_at_silence(pcm: np.ndarray, rate: int, min_s: float = 0.02) -> list[np.ndarray]:
    """`pcm` cut where it falls silent for `min_s` or more: a held track plays digital silence
    (Opus gives it back as zeros), which speech has none of, for as little as one frame."""
    n = rate // 100
    quiet = np.sqrt((pcm[: len(pcm) // n * n].reshape(-1, n) ** 2).mean(axis=1)) < SOUNDING / 100
    parts, start, i = [], 0, 0
    while i < len(quiet):
        j = i
        while j < len(quiet) and quiet[j]:
            j += 1
        if j - i >= min_s * 100:
            parts.append(pcm[start * n : i * n])
            start = j
        i = j + 1
    parts.append(pcm[start * n :])
    return [p for p in parts if len(trimmed(p))]


def hearing(parts: list[np.ndarray], reference: np.ndarray, rate: int) -> Hearing:
    """How `parts` (what was played, in order, its breaks between them) heard `reference`."""
    parts = [t for p in parts if len(t := trimmed(p)) > rate // 50]
    found = [align(p, reference) for p in parts]
    return Hearing(tuple(c for c, _ in found),
                   tuple((lag, lag + len(p)) for (_, lag), p in zip(found, parts, strict=True)),
                   sum(sounding_s(p, rate) for p in parts), sounding_s(reference, rate), rate)


def assert_heard_whole(h: Hearing, *, max_repeat_s: float = 0.06) -> None:
    """The reply heard whole, at most with a gap: every part lines up (correlation >= 0.95), in
    order, no more than a round trip played twice, and it sounded as long (within 5 %)."""
    assert min(h.correlations) >= 0.95, h
    assert h.in_order and h.repeated_s <= max_repeat_s, h
    assert abs(h.sounding_s - h.reference_sounding_s) <= 0.05 * h.reference_sounding_s, h
