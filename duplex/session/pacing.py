"""Releasing reply audio at real time, a bounded lead ahead of what the listener has played.

Pure and clock-free: callers pass `now` as a sample count on the output clock. Where the
carrier reports playback itself (a media track), its playhead is the truth; otherwise playback
is assumed continuous from the moment audio last (re)started after running dry.

Audio goes out in whole frames, not whole chunks: a chunk of the model's (80-160 ms) released
once its start came within the lead would leave the listener holding the lead and most of a
chunk, all of which it plays after a pause. Released frames are kept until the listener is
known to have played them (`heard`), when the carrier can empty its buffer and have them sent
again (`resend_from`): Twilio's `clear`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Generic, TypeVar

from duplex.session.events import OutputChunk

P = TypeVar("P")
"""A chunk's audio as the carrier takes it (an array, bytes): one item per sample, sliceable."""


class OutputPacer(Generic[P]):
    def __init__(self, lead_samples: int, frame_samples: int = 1, *,
                 keep_unheard: bool = False) -> None:
        self.lead_samples = lead_samples
        self.frame_samples = frame_samples
        """Audio is released in whole frames of this many samples, on the output clock's grid
        (a reply at another speed has chunks of any length: the grid keeps what the listener
        holds whole frames all the same)."""
        self.keep_unheard = keep_unheard
        self._queue: deque[tuple[OutputChunk, P]] = deque()
        self._unheard: deque[tuple[OutputChunk, P]] = deque()
        """Released pieces not yet known heard, oldest first (with keep_unheard)."""
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
        self._unheard.clear()

    def rewind(self, sent_samples: int) -> None:
        """The output track was cut back to `sent_samples` (a barge-in or a truncate)."""
        if self.tx_samples > sent_samples:
            self.tx_samples = sent_samples
            self._anchor = None

    def heard(self, position: int) -> None:
        """The listener has played the output track up to `position`: what lies before it will
        never be sent again."""
        while self._unheard:
            chunk, payload = self._unheard[0]
            end = chunk.start_sample + chunk.n_samples
            if end <= position:
                self._unheard.popleft()
            elif chunk.start_sample < position:
                self._unheard[0] = _split(chunk, payload, position - chunk.start_sample)[1]
                return
            else:
                return

    def resend_from(self, position: int) -> None:
        """The carrier dropped everything it held past `position` (what the listener is known
        to have heard): released audio from there goes out again, ahead of the rest, and
        playback restarts with it."""
        if not self.keep_unheard:
            raise ValueError("a resend needs a pacer that keeps what it released (keep_unheard)")
        self.heard(position)
        if self._unheard:
            self.tx_samples = self._unheard[0][0].start_sample
            self._queue.extendleft(reversed(self._unheard))
            self._unheard.clear()
        self._anchor = None

    def played(self, now: int) -> int:
        if self.playhead is not None:
            return min(self.tx_samples, self.playhead)
        if self._anchor is None:
            return self.tx_samples
        pos, at = self._anchor
        return min(self.tx_samples, pos + max(0, now - at))

    def due(self, now: int) -> list[tuple[OutputChunk, P]]:
        """The audio that starts less than the lead ahead of playback at `now`, in order: whole
        frames, the chunk they belong to split where the lead ends."""
        out = []
        # With no lead at all, a frame is due the moment playback reaches its start.
        lead = max(self.lead_samples, 1)
        frame = self.frame_samples
        while self._queue:
            played = self.played(now)
            chunk, payload = self._queue[0]
            if chunk.start_sample >= played + lead:
                break
            n = -(-(played + lead) // frame) * frame - chunk.start_sample
            if n < chunk.n_samples:
                piece, self._queue[0] = _split(chunk, payload, n)
            else:
                piece = self._queue.popleft()
            if played >= self.tx_samples:
                self._anchor = (chunk.start_sample, now)
            self.tx_samples = chunk.start_sample + piece[0].n_samples
            if self.keep_unheard:
                self._unheard.append(piece)
            out.append(piece)
        return out


def _split(chunk: OutputChunk, payload: P, n: int) -> tuple[tuple[OutputChunk, P], tuple[OutputChunk, P]]:
    """`chunk` as its first `n` samples (with its text) and the rest."""
    head = replace(chunk, n_samples=n)
    tail = replace(chunk, start_sample=chunk.start_sample + n, n_samples=chunk.n_samples - n,
                   text="")
    return (head, payload[:n]), (tail, payload[n:])
