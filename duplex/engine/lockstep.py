"""Native full-duplex sessions, stepped in lockstep: one batched model step per tick.

Each duplex session has a frame clock on its input timeline: a frame is due one frame after
the one before it, or when it arrives if it comes later than that (a client that bursts ahead
is paced at real time; one that pauses is not counted behind). A tick steps every session whose
oldest unprocessed frame is due (or nearly: `JOIN_EARLY`), one frame each, in one `duplex_step` of the model (one batched
call per stage); each session gets one output frame back, silence included, placed on the
timeline right after the input frame that produced it (the model's own delay is inside its
output: `DuplexModel.duplex_delay_frames`).

Falling behind never bursts and never lets latency grow: a session whose oldest unprocessed
frame is more than `max_lag_ms` past due drops every due frame but the newest (a `Drop` with
reason `behind`, and a `DuplexDropped` to its session) and goes on from there; the timeline
stays exact because frames keep their absolute positions. What a tick costs is measured, so
admission can refuse a session that would push the tick past the frame budget.

No threads here: the engine core calls `push`, `due` and `step` from its worker thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.engine.scheduler import Drop
from duplex.engine.stats import EngineStats
from duplex.engine.timing import StageClock
from models.base import DuplexModel, ModelState

JOIN_EARLY = 0.5
"""A tick also steps sessions whose frame is due within this fraction of a frame: their input
is here already, and sessions whose clocks started apart come to share ticks."""
TICK_COST_WEIGHT = 0.2
"""Weight of the newest tick in the measured tick cost (an exponential average)."""


@dataclass(frozen=True, slots=True)
class DuplexOut:
    """One output frame of a duplex session: silence included, `voiced` when the model speaks."""

    session_id: str
    epoch: int
    index: int
    """The input frame whose step produced it."""
    pcm: Any
    text: str
    voiced: bool
    media_start: int
    """Its first sample on the session's output clock (the end of input frame `index`)."""
    late_ms: float
    """How long after its input frame was due it came out."""


@dataclass(frozen=True, slots=True)
class DuplexDropped:
    """Input frames of a duplex session the engine skipped (it fell behind), as samples."""

    session_id: str
    n_samples: int
    reason: str


@dataclass
class _Frame:
    index: int
    pcm: np.ndarray
    media_start: int
    due: float


@dataclass
class DuplexSlot:
    session_id: str
    epoch: int
    next_sample: int
    """Where the next input frame starts on the input timeline."""
    frames: deque[_Frame] = field(default_factory=deque)
    last_due: float | None = None
    next_index: int = 0

    @property
    def queued_bytes(self) -> int:
        return sum(f.pcm.nbytes for f in self.frames)


@dataclass(frozen=True, slots=True)
class TickCost:
    """The measured cost of one tick and how many sessions it stepped."""

    ms: float
    sessions: int


class Lockstep:
    def __init__(self, model: DuplexModel, max_lag_ms: int, stats: EngineStats,
                 batching: bool = True, clock: Callable[[], float] = time.monotonic,
                 stage_clock: StageClock | None = None) -> None:
        """`stage_clock` times each stage call of a step (the tick itself is wall time: what
        the frame budget is spent on)."""
        self.model = model
        self.clock = clock
        self.stage_clock = stage_clock or StageClock(model.device, clock)
        self.frame = model.input_chunk_samples
        self.frame_s = self.frame / model.input_rate
        self.max_lag_s = max_lag_ms / 1000
        self.stats = stats
        self.batching = batching
        self.slots: dict[str, DuplexSlot] = {}
        self.drops: list[Drop] = []
        self.tick_ms: float | None = None
        """Measured cost of a tick (exponential average), None before the first."""
        self.tick_sessions = 0

    def join(self, session_id: str, epoch: int, input_samples: int) -> None:
        """The session runs duplex from the next frame, starting at `input_samples`."""
        if session_id not in self.slots:
            self.slots[session_id] = DuplexSlot(session_id, epoch, input_samples)

    def leave(self, session_id: str, reason: str = "closed") -> None:
        slot = self.slots.pop(session_id, None)
        if slot is not None and slot.frames:
            self.drops.append(Drop(session_id, "duplex_frame", len(slot.frames),
                                   slot.queued_bytes, reason))

    def cancel(self, session_id: str, new_epoch: int) -> None:
        """Output from here on carries `new_epoch`; the model keeps listening as before."""
        slot = self.slots.get(session_id)
        if slot is not None and new_epoch > slot.epoch:
            slot.epoch = new_epoch

    def clear(self, session_id: str) -> None:
        slot = self.slots.get(session_id)
        if slot is not None and slot.frames:
            self.drops.append(Drop(session_id, "duplex_frame", len(slot.frames),
                                   slot.queued_bytes, "cleared"))
            slot.frames.clear()

    def push(self, session_id: str, pcm: np.ndarray, now: float) -> None:
        slot = self.slots[session_id]
        if len(pcm) != self.frame:
            # A partial frame (a flush) waits for nothing: pad it to a whole frame of silence.
            pcm = np.pad(pcm, (0, self.frame - len(pcm)))
        due = now if slot.last_due is None else max(now, slot.last_due + self.frame_s)
        slot.last_due = due
        slot.frames.append(_Frame(slot.next_index, pcm, slot.next_sample, due))
        slot.next_index += 1
        slot.next_sample += self.frame

    def queued_bytes(self, session_id: str) -> int:
        slot = self.slots.get(session_id)
        return 0 if slot is None else slot.queued_bytes

    def next_due(self) -> float | None:
        """When the earliest unprocessed frame of any session is due; None with none waiting."""
        times = [s.frames[0].due for s in self.slots.values() if s.frames]
        return min(times) if times else None

    def _resync(self, slot: DuplexSlot, now: float) -> list[DuplexDropped]:
        if now - slot.frames[0].due <= self.max_lag_s:
            return []
        gone = [f for f in slot.frames if f.due <= now][:-1]
        for _ in gone:
            slot.frames.popleft()
        self.drops.append(Drop(slot.session_id, "duplex_frame", len(gone),
                               sum(f.pcm.nbytes for f in gone), "behind"))
        return [DuplexDropped(slot.session_id, len(gone) * self.frame, "behind")]

    def step(self, states: dict[str, ModelState], now: float) -> list[DuplexOut | DuplexDropped]:
        """One tick: every session with a due frame steps one frame, in one model step."""
        events: list[DuplexOut | DuplexDropped] = []
        ready: list[tuple[DuplexSlot, _Frame]] = []
        early = now + JOIN_EARLY * self.frame_s
        if (first := self.next_due()) is None or first > now:
            return events
        for slot in self.slots.values():
            if not slot.frames or slot.frames[0].due > early:
                continue
            events += self._resync(slot, now)
            ready.append((slot, slot.frames.popleft()))
        if not ready:
            return events
        t0 = self.clock()
        groups = [ready] if self.batching else [[pair] for pair in ready]
        outs = []
        for group in groups:
            outs += self.model.duplex_step([states[s.session_id] for s, _ in group],
                                           [f.pcm for _, f in group], self._timer)
        done = self.clock()
        self._measure((done - t0) * 1000, len(ready))
        ratio = self.model.output_rate / self.model.input_rate
        for (slot, frame), out in zip(ready, outs, strict=True):
            late_ms = (done - frame.due) * 1000
            start = round((frame.media_start + self.frame) * ratio)
            events.append(DuplexOut(slot.session_id, slot.epoch, frame.index, out.pcm, out.text,
                                    out.voiced, start, late_ms))
        return events

    def _measure(self, ms: float, sessions: int) -> None:
        self.tick_ms = ms if self.tick_ms is None else (
            (1 - TICK_COST_WEIGHT) * self.tick_ms + TICK_COST_WEIGHT * ms)
        self.tick_sessions = sessions
        st = self.stats.stages["duplex_tick"]
        st.compute_ms.append(ms)
        st.batch_sizes.append(sessions)

    @contextmanager
    def _timer(self, stage: str, batch_size: int):
        st = self.stats.stages[f"duplex_{stage}"]
        with self.stage_clock.timed(st.compute_ms):
            yield
        st.batch_sizes.append(batch_size)

    def cost(self) -> TickCost | None:
        return None if self.tick_ms is None else TickCost(self.tick_ms, self.tick_sessions)


def admit_duplex(cost: TickCost | None, n_duplex: int, frame_ms: float, max_load: float) -> str | None:
    """Why one more duplex session would not fit the frame budget, or None if it would.

    The tick cost grows with the sessions it steps; one more is projected from the last tick's
    cost per session, which overestimates a batched step (its cost grows slower than linearly):
    refusing a little early beats every session falling behind."""
    if cost is None or not n_duplex or not cost.sessions:
        return None
    projected = cost.ms * (n_duplex + 1) / cost.sessions
    budget = frame_ms * max_load
    if projected <= budget:
        return None
    return (f"a duplex tick of {n_duplex + 1} sessions would take about {projected:.1f} ms, past "
            f"the {frame_ms:.0f} ms frame (limit engine.max_load={max_load:.0%} of it)")

