"""A reply at `audio.output.speed`: its tempo changed, its pitch kept.

FFmpeg's `atempo` (WSOLA: overlapping windows of the signal laid closer together or further
apart, each placed where it best matches the last) through PyAV's filter graph. The graph lives
as long as the reply and carries its state from chunk to chunk, so the output is the same as
the whole reply's at once, with no seam at chunk boundaries. atempo takes factors from 0.5 to
2, so a slower speed is a chain of them (0.25 = 0.5 x 0.5).

The words of a reply move with the sounds they start with: a word that started at sample `p`
of the reply at its own tempo starts at `p / speed` of what the listener hears. Everything
counted after this stage (the session clock's output samples, marks, truncation, the heard
watermark, the echo guard's reference) is then in the listener's time.
"""

from __future__ import annotations

from collections import deque
from fractions import Fraction

import numpy as np

_ATEMPO_MIN = Fraction(1, 2)


def _factors(speed: Fraction) -> list[Fraction]:
    """`speed` as atempo factors, each within its range."""
    factors = []
    while speed < _ATEMPO_MIN:
        factors.append(_ATEMPO_MIN)
        speed /= _ATEMPO_MIN
    return [*factors, speed]


def as_fraction(speed: float) -> Fraction:
    """The speed a client sent (a JSON number) as an exact ratio of sample counts."""
    return Fraction(speed).limit_denominator(1000)


class Tempo:
    """Float32 mono at `rate`, chunk by chunk, at `speed` (not 1)."""

    def __init__(self, rate: int, speed: Fraction) -> None:
        # PyAV is a transport's package, absent where only the engine and bench run (a GPU
        # host): only a reply at a speed other than 1 needs it.
        import av
        import av.filter

        self._av = av
        self.rate = rate
        self._graph = av.filter.Graph()
        time_base = Fraction(1, rate)
        node = source = self._graph.add_abuffer(format="flt", sample_rate=rate, layout="mono",
                                                time_base=time_base)
        for factor in _factors(speed):
            stage = self._graph.add("atempo", f"tempo={float(factor)}")
            node.link_to(stage)
            node = stage
        sink = self._graph.add("abuffersink")
        node.link_to(sink)
        self._graph.configure()
        self._source = source
        self._pts = 0
        self._time_base = time_base

    def process(self, pcm: np.ndarray) -> np.ndarray:
        if len(pcm):
            frame = self._av.AudioFrame.from_ndarray(
                np.ascontiguousarray(pcm, np.float32).reshape(1, -1), format="flt",
                layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate, self._pts, self._time_base
            self._pts += len(pcm)
            self._graph.push(frame)
        return self._pull()

    def finish(self) -> np.ndarray:
        """What the filter still holds once the reply has ended."""
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (self._av.BlockingIOError, self._av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out) if out else np.zeros(0, np.float32)


Piece = tuple[np.ndarray, str]
"""Reply audio on the session clock, and the text that starts with its first sample."""


class ReplyTempo:
    """The reply being voiced, at its speed, with its words placed in the listener's time. At
    speed 1 audio and words pass through untouched."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.speed = Fraction(1)
        self._tempo: Tempo | None = None
        self._in = 0
        """Samples of the reply at its own tempo so far."""
        self._out = 0
        """Samples of it the filter has given back so far (the listener's time)."""
        self._words: deque[tuple[int, str]] = deque()
        """Text waiting for the sound it starts with: (place in the output, text)."""

    def start(self, speed: float) -> None:
        """A new reply, voiced at `speed`."""
        self.speed = as_fraction(speed)
        self._tempo = None if self.speed == 1 else Tempo(self.rate, self.speed)
        self._in = self._out = 0
        self._words.clear()

    def reset(self) -> None:
        """The reply was cut: what the filter holds of it is dropped."""
        self.start(1.0)

    def process(self, pcm: np.ndarray, text: str) -> list[Piece]:
        if self._tempo is None:
            return [(pcm, text)]
        if text:
            self._words.append((self._in * self.speed.denominator // self.speed.numerator,
                                text))
        self._in += len(pcm)
        return self._place(self._tempo.process(pcm), last=False)

    def finish(self, pcm: np.ndarray) -> list[Piece]:
        """The reply's last audio (a resampler's tail), then what the filter still holds."""
        if self._tempo is None:
            return [(pcm, "")]
        self._in += len(pcm)
        out = np.concatenate([self._tempo.process(pcm), self._tempo.finish()])
        pieces = self._place(out, last=True)
        self._tempo = None
        return pieces

    def _place(self, out: np.ndarray, *, last: bool) -> list[Piece]:
        """Cut `out` where words start; a word whose sound has not come out yet waits (at the
        reply's end, it goes with the last piece)."""
        pieces: list[Piece] = []
        cut, text = 0, ""
        end = self._out + len(out)
        while self._words and (self._words[0][0] < end or last):
            at, word = self._words.popleft()
            place = min(max(at - self._out, cut), len(out))
            if place > cut:
                pieces.append((out[cut:place], text))
                cut, text = place, ""
            text += word
        if cut < len(out) or text:
            pieces.append((out[cut:], text))
        self._out = end
        return pieces
