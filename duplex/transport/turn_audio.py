"""A turn's audio on its way to the two models that hear it.

`InputGate`: what the Thinker hears of a turn starts at its speech onset less
`prefix_padding_ms` (OpenAI's `audio_start_ms`): while no turn is under way, input at the
model's rate is held back, the last few seconds of it, and a speech start releases it from
that point; the silence before is never given to the model. A commit closes the turn.

`HeardAudio`: the last seconds of what the speech detector heard (16 kHz, the echo of our own
reply taken out), which the end-of-turn model scores at a pause.

Both are plain numpy on sample counts, fed and read by `MediaClock` on the event loop.
"""

from __future__ import annotations

from collections import deque

import numpy as np

_EMPTY = np.zeros(0, np.float32)


class _Span:
    """Consecutive audio chunks that start at sample `start`, of which the last `keep` stay."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.chunks: deque[np.ndarray] = deque()
        self.start = 0
        self.end = 0

    def append(self, pcm: np.ndarray) -> None:
        if len(pcm):
            self.chunks.append(pcm)
            self.end += len(pcm)
        while self.chunks and self.end - self.start - len(self.chunks[0]) >= self.keep:
            self.start += len(self.chunks.popleft())

    def since(self, sample: int) -> np.ndarray:
        """What is kept from `sample` (or from the oldest kept, if that is later) to the end."""
        if not self.chunks:
            return _EMPTY
        whole = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        return whole[max(0, sample - self.start):]

    def take(self) -> np.ndarray:
        """All that is kept, which is then forgotten."""
        out = self.since(self.start)
        self.clear()
        return out

    def skip(self, n: int) -> None:
        """`n` samples went by that are not kept."""
        self.clear()
        self.start = self.end = self.end + n

    def clear(self) -> None:
        self.chunks.clear()
        self.start = self.end


class InputGate:
    def __init__(self, rate: int, model_rate: int, keep_s: float = 3.0) -> None:
        self.rate = rate
        self.model_rate = model_rate
        self.enabled = False
        """Off: every sample goes to the model at once (no speech detection, native duplex)."""
        self.in_turn = False
        self._held = _Span(round(keep_s * model_rate))
        self._release: list[np.ndarray] = []

    def feed(self, pcm: np.ndarray) -> np.ndarray:
        """Input at the model's rate in; what goes to the model now out."""
        if self.enabled and not self.in_turn:
            self._held.append(pcm)
            return self.flush()
        if self._held.chunks:
            # Held while the gate was on: the uncommitted buffer, which now goes on.
            self._release.append(self._held.take())
        self._held.skip(len(pcm))
        self._release.append(pcm)
        return self.flush()

    def open(self, from_clock_sample: int) -> None:
        """A turn's speech started: the model hears it from `from_clock_sample` (the onset less
        the prefix padding, on the session clock), with what comes next."""
        if not self.enabled or self.in_turn:
            return
        self.in_turn = True
        self._release.append(self._held.since(from_clock_sample * self.model_rate // self.rate))
        self._held.clear()

    def commit(self, asked: bool = False) -> np.ndarray:
        """The turn is committed: what it still holds goes to the model now, and the next turn
        waits for its speech. A commit the client `asked` for with no speech detected gives
        the model what is held back (OpenAI commits the whole buffer); any other (an idle
        timeout's) gives it nothing of that silence."""
        if self.enabled and not self.in_turn:
            held = self._held.take()
            if asked:
                self._release.append(held)
        self.in_turn = False
        return self.flush()

    def forget(self) -> None:
        """The speech was no turn (a false interruption): what follows is held again."""
        self.in_turn = False

    def clear(self) -> None:
        """The input buffer was cleared: nothing held or waiting goes to the model."""
        self._held.clear()
        self._release = []

    def flush(self) -> np.ndarray:
        out, self._release = self._release, []
        if not out:
            return _EMPTY
        return np.concatenate(out) if len(out) > 1 else out[0]


class HeardAudio:
    """The speech detector's input (16 kHz), the last `keep_s` seconds of it: the 8 s the
    end-of-turn model hears, and the detector's lag behind the latest audio."""

    def __init__(self, rate: int, keep_s: float = 8.5) -> None:
        self.rate = rate
        self._span = _Span(round(keep_s * rate))

    def append(self, pcm: np.ndarray) -> None:
        self._span.append(pcm)

    def window(self, start: int, end: int) -> np.ndarray:
        """Samples `start` to `end` (as far as they are still kept)."""
        return self._span.since(start)[: max(0, end - max(start, self._span.start))]
