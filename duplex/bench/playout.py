"""What a listener plays, on the listener's own clock: the playback side of the bench's and the
tests' peers (a phone behind Twilio, a WebSocket client, a WebRTC peer).

Pure: every call takes `now`, a sample count on the listener's clock, so a test drives it with
any clock it likes and the peers pass their wall clock. Audio plays back to back in real time
from when it arrives (or from when what came before it ends), as a phone's or a browser's
buffer plays it; `clear` drops what has not played yet, at once, as Twilio's `clear` and a
client's flush at `speech_started` do; a mark comes back when playback reaches it, or at once
when a clear drops it, as Twilio's do.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Segment:
    start: int
    """Clock sample at which its first sample plays."""
    pcm: np.ndarray
    tag: Any
    """Whose audio it is (a reply's id), or None (silence, or not known)."""
    sent: int
    """Clock sample at which the server sent it, as far as the listener can tell (when it
    arrived, unless the listener knows better)."""

    @property
    def end(self) -> int:
        return self.start + len(self.pcm)


class Playout:
    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.end = 0
        """Clock sample at which what is queued runs out."""
        self._marks: deque[tuple[int, str]] = deque()
        self.clears: list[int] = []
        self.first: dict[Any, int] = {}
        """Clock sample at which each tag's audio first played."""

    def push(self, now: int, pcm: np.ndarray, tag: Any = None, sent: int | None = None) -> int:
        """Queue `pcm` to play after what is queued; returns the clock sample it starts at."""
        start = max(now, self.end)
        if len(pcm):
            self.segments.append(Segment(start, np.asarray(pcm, np.float32), tag,
                                         now if sent is None else sent))
            self.end = start + len(pcm)
            self.first.setdefault(tag, start)
        return start

    def mark(self, now: int, name: str) -> int:
        """A mark after what is queued; returns the clock sample at which playback reaches it."""
        at = max(now, self.end)
        self._marks.append((at, name))
        return at

    def next_mark(self) -> int | None:
        """When playback reaches the first mark still pending."""
        return self._marks[0][0] if self._marks else None

    def reached(self, now: int) -> list[str]:
        """The marks playback has reached by `now` (each once), in order."""
        out = []
        while self._marks and self._marks[0][0] <= now:
            out.append(self._marks.popleft()[1])
        return out

    def clear(self, now: int) -> list[str]:
        """Drop what has not played by `now`; returns the marks it dropped (those playback had
        not reached: the others are still for `reached`)."""
        dropped = [name for at, name in self._marks if at > now]
        self._marks = deque((at, name) for at, name in self._marks if at <= now)
        self.clears.append(now)
        self.take(now)
        return dropped

    def take(self, now: int) -> list[tuple[np.ndarray, Any]]:
        """Stop playing at `now`: what had not played comes back, (audio, tag) in order, for a
        player that pauses to queue again when it resumes."""
        kept, taken = [], []
        for s in self.segments:
            if s.end <= now:
                kept.append(s)
                continue
            if s.start < now:
                kept.append(Segment(s.start, s.pcm[: now - s.start], s.tag, s.sent))
            taken.append((s.pcm[max(0, now - s.start) :], s.tag))
        self.segments = kept
        self.end = min(self.end, now)
        return taken

    def _at(self, now: int) -> Segment | None:
        """The segment playing at `now` (they play in order: the search stops at the first
        that ended by then)."""
        for s in reversed(self.segments):
            if s.end <= now:
                return None
            if s.start <= now:
                return s
        return None

    def playing(self, now: int, tag: Any = None) -> bool:
        """Whether a sample (of `tag`, if given) plays at `now`."""
        s = self._at(now)
        return s is not None and (tag is None or s.tag == tag)

    def tag_at(self, now: int) -> Any:
        s = self._at(now)
        return None if s is None else s.tag

    def stopped(self, since: int, tag: Any) -> int | None:
        """Where playback of `tag` that was under way at `since` stopped: the end of its last
        sample played without a break from there. None if none played at `since`."""
        run = [s for s in self.segments if s.tag == tag and s.end > since]
        if not run or run[0].start > since:
            return None
        end = run[0].end
        for s in run[1:]:
            if s.start != end:
                break
            end = s.end
        return end

    def between(self, a: int, b: int) -> np.ndarray:
        """What played from clock sample `a` to `b`, whoever's (silence where nothing did): what
        a loudspeaker gave out then."""
        out = np.zeros(b - a, np.float32)
        for s in reversed(self.segments):
            if s.end <= a:
                break
            lo, hi = max(a, s.start), min(b, s.end)
            if lo < hi:
                out[lo - a : hi - a] = s.pcm[lo - s.start : hi - s.start]
        return out

    def played(self, now: int) -> int:
        """Samples played by `now`, whoever's."""
        return sum(min(len(s.pcm), max(0, now - s.start)) for s in self.segments)

    def last_played(self, tag: Any, sent_by: int) -> int | None:
        """Where playback of what the server sent of `tag` by `sent_by` ended: the end of its
        last sample played (a clear or a flush may have cut it short)."""
        return max((s.end for s in self.segments if s.tag == tag and s.sent <= sent_by),
                   default=None)

    def heard(self, tag: Any, now: int | None = None) -> np.ndarray:
        """Every sample of `tag` played (by `now`), in the order played, breaks left out."""
        parts = [s.pcm if now is None or s.end <= now else s.pcm[: max(0, now - s.start)]
                 for s in self.segments if s.tag == tag]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def breaks(self, tag: Any) -> list[tuple[int, int]]:
        """(from, to) on the clock of every gap in the playback of `tag`."""
        mine = [s for s in self.segments if s.tag == tag]
        return [(a.end, b.start) for a, b in zip(mine, mine[1:], strict=False) if b.start > a.end]
