"""Releasing reply audio at real time, a bounded lead ahead of what the listener has played.

Pure and clock-free: callers pass `now` as a sample count on the output clock. Where the
carrier reports playback itself (a media track), its playhead is the truth; otherwise playback
is assumed continuous from the moment audio last (re)started after running dry.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from duplex.session.events import OutputChunk

P = TypeVar("P")


class OutputPacer(Generic[P]):
    def __init__(self, lead_samples: int) -> None:
        self.lead_samples = lead_samples
        self._queue: deque[tuple[OutputChunk, P]] = deque()
        self.tx_samples = 0
        """End, on the output clock, of what has been released to the carrier."""
        self._anchor: tuple[int, int] | None = None
        """(output position, clock sample) at which continuous playback last (re)started."""
        self.playhead: int | None = None

    def __bool__(self) -> bool:
        return bool(self._queue)

    def push(self, chunk: OutputChunk, payload: P) -> None:
        self._queue.append((chunk, payload))

    def flush(self) -> None:
        self._queue.clear()

    def rewind(self, sent_samples: int) -> None:
        """The output track was cut back to `sent_samples` (a barge-in or a truncate)."""
        if self.tx_samples > sent_samples:
            self.tx_samples = sent_samples
            self._anchor = None

    def played(self, now: int) -> int:
        if self.playhead is not None:
            return min(self.tx_samples, self.playhead)
        if self._anchor is None:
            return self.tx_samples
        pos, at = self._anchor
        return min(self.tx_samples, pos + max(0, now - at))

    def due(self, now: int) -> list[tuple[OutputChunk, P]]:
        """Chunks that start less than the lead ahead of playback at `now`, in order."""
        out = []
        # With no lead at all, a chunk is due the moment playback reaches its start.
        lead = max(self.lead_samples, 1)
        while self._queue:
            played = self.played(now)
            chunk, payload = self._queue[0]
            if chunk.start_sample >= played + lead:
                break
            self._queue.popleft()
            if played >= self.tx_samples:
                self._anchor = (chunk.start_sample, now)
            self.tx_samples = chunk.start_sample + chunk.n_samples
            out.append((chunk, payload))
        return out
