"""A polyphase FIR resampler whose state is a few plain numbers and samples, for a session's
input path (8 kHz G.711 onto the session clock, the session clock onto the model's rate): a
resume on another node re-primes one from the saved state and it goes on sample for
sample, releasing the same samples at the same inputs, as the uninterrupted one would.

soxr cannot do that: its filters work on blocks fixed from the stream's first sample, so a
restarted stream differs by a float rounding and releases its output at other times (which
moves samples across the turn a commit closes). Here output `k` is released once the input it
needs is in, and each is summed tap by tap in one fixed order, whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np

TAPS_PER_PHASE = 64
"""Filter length in input samples (at the lower rate when downsampling): ~2 kHz transition
band for 24 -> 16 kHz, 1.3 ms delay."""
KAISER_BETA = 8.6
"""~85 dB stopband."""
CUTOFF = 0.94
"""Of the lower rate's Nyquist frequency."""


@dataclass(frozen=True)
class ResamplerState:
    """What a fresh `FirResampler` needs to go on where another stood: its last input samples
    (as many as the filter reaches back), how many it was fed and how many it gave."""

    tail: np.ndarray
    fed: int
    emitted: int


@dataclass(frozen=True)
class InputResamplers:
    """Where each resampler on a session's input path stands, for a resume to go on from."""

    model: ResamplerState
    """Session clock -> the model's input rate."""
    g711: ResamplerState | None = None
    """8 kHz G.711 -> the session clock; None while no G.711 audio has come in."""


class FirResampler:
    def __init__(self, in_rate: int, out_rate: int) -> None:
        g = gcd(in_rate, out_rate)
        self.in_rate, self.out_rate = in_rate, out_rate
        self.up, self.down = out_rate // g, in_rate // g
        span = TAPS_PER_PHASE * max(1, self.down // self.up)
        n = span * self.up
        t = np.arange(n) - (n - 1) / 2
        cutoff = CUTOFF * 0.5 * min(in_rate, out_rate) / (in_rate * self.up)
        h = 2 * cutoff * np.sinc(2 * cutoff * t) * np.kaiser(n, KAISER_BETA) * self.up
        # phases[p, j] weighs input i_max - j for an output whose upsampled position is
        # i_max * up + p.
        phases = np.stack([h[p::self.up][:span] for p in range(self.up)])
        # Reversed, so that a phase lines up with a window of inputs read oldest first.
        self._reversed = np.ascontiguousarray(phases[:, ::-1], dtype=np.float32)
        self.span = span
        # The filter's centre, on the upsampled grid: output k is read this much later, so it
        # lands where its input was (no delay on the session clock) once that input is in.
        self._centre = n // 2
        self.lookahead = -(-self._centre // self.down)
        """Output samples held back until the input they centre on is in (1.3 ms for 24 ->
        16 kHz, 4 ms for 8 -> 24 kHz)."""
        self.fed = 0
        self.emitted = 0
        self._buf = np.zeros(span, np.float32)
        """The last `span` inputs and any not yet used, the first at input index `_base`."""
        self._base = -span

    def process(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self.up == self.down:
            self.fed += len(samples)
            self.emitted += len(samples)
            return samples
        self._buf = np.concatenate([self._buf, samples])
        self.fed += len(samples)
        # Output k sits at upsampled position k * down; the filter centred there needs inputs
        # up to k * down + centre.
        ready = max(self.emitted, -(-(self.fed * self.up - self._centre) // self.down))
        n = ready - self.emitted
        out = np.empty(n, np.float32)
        buf, size = self._buf, self._buf.itemsize
        # Every up-th output uses the same phase and reads a window `down` inputs further on, so
        # each phase is one strided view of the input (no copy, no gather) times a row of taps.
        for r in range(min(self.up, n)):
            pos = (self.emitted + r) * self.down + self._centre
            first = pos // self.up - self._base - self.span + 1
            rows = np.ndarray((len(range(r, n, self.up)), self.span), np.float32, buffer=buf,
                              offset=first * size, strides=(self.down * size, size))
            # Each output is one fixed-length row summed in one fixed order, whatever the
            # chunking: a resumed stream adds exactly as the uninterrupted one did.
            out[r :: self.up] = np.einsum("ij,j->i", rows, self._reversed[pos % self.up])
        self.emitted = ready
        drop = max(0, len(self._buf) - self.span)
        self._buf = self._buf[drop:]
        self._base += drop
        return out

    def state(self) -> ResamplerState:
        return ResamplerState(self._buf.copy(), self.fed, self.emitted)

    @classmethod
    def resume(cls, in_rate: int, out_rate: int, state: ResamplerState) -> FirResampler:
        r = cls(in_rate, out_rate)
        r.fed, r.emitted = state.fed, state.emitted
        r._buf = np.concatenate([np.zeros(max(0, r.span - len(state.tail)), np.float32),
                                 state.tail.astype(np.float32)])
        r._base = state.fed - len(r._buf)
        return r
