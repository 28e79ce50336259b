"""The engine loop: one worker thread that plans a step, runs each stage as one batched model
call across sessions, and routes the results. Nothing here runs on the asyncio loop; callers
talk to it through thread-safe methods and get results through their `deliver` callback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from duplex.engine.scheduler import (
    AudioOut,
    Drop,
    EngineFull,
    ResponseFinished,
    ResponseTimings,
    Scheduler,
    SchedulerConfig,
    SessionFailed,
    Stage,
    StepPlan,
)
from duplex.engine.stats import EngineStats
from duplex.media import Framer
from models.base import DuplexModel, ModelState

log = logging.getLogger("duplex.engine")
Deliver = Callable[[AudioOut | ResponseFinished | ResponseTimings | SessionFailed], None]


def resolve_torch_threads(requested: int) -> int:
    """Threads for torch's CPU kernels. With 0, all cores but one: the event loop and the VAD
    need a core of their own, or torch's pool and they slow each other down several times."""
    import os

    return requested or max(1, (os.cpu_count() or 1) - 1)


def set_torch_threads(requested: int) -> int:
    import torch

    n = resolve_torch_threads(requested)
    torch.set_num_threads(n)
    return n


class AdmissionRefused(Exception):
    """A new session would push the engine past real time; `limit` names the setting."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass
class EngineConfig:
    max_sessions: int = 64
    max_load: float = 0.85
    """Busy fraction of the engine loop above which new sessions are refused."""
    batching: bool = True
    """False runs one model call per session per stage: the per-session baseline."""
    scheduler: SchedulerConfig | None = None


def admit(n_open: int, load: float, config: EngineConfig) -> None:
    """Raise AdmissionRefused if one more session would pass a limit; `load` is the measured
    busy fraction with `n_open` sessions."""
    if n_open >= config.max_sessions:
        raise AdmissionRefused(
            f"engine is full: {n_open} sessions open (limit engine.max_sessions="
            f"{config.max_sessions})",
            "engine.max_sessions",
        )
    projected = load * (n_open + 1) / n_open if n_open else load
    if n_open and projected > config.max_load:
        raise AdmissionRefused(
            f"engine would exceed real time: load {load:.0%} with {n_open} sessions, "
            f"{projected:.0%} with one more (limit engine.max_load={config.max_load:.0%})",
            "engine.max_load",
        )


@dataclass
class _Caller:
    """What the calling side keeps per session (touched only from the caller's thread)."""

    framer: Framer
    deliver: Deliver


class Engine:
    def __init__(self, model: DuplexModel, config: EngineConfig | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        base = self.config.scheduler or SchedulerConfig()
        sched_cfg = replace(base, output_rate=model.output_rate,
                            token_lead=min(base.token_lead, model.max_thinker_lead))
        self.scheduler = Scheduler(self.config.max_sessions, sched_cfg)
        self.stats = EngineStats()
        self.load = 0.0
        self._states: dict[str, ModelState] = {}
        self._callers: dict[str, _Caller] = {}
        self._bytes: dict[str, int] = {}
        self._drops: list[Drop] = []
        self._control: queue.SimpleQueue[tuple[str, tuple[Any, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.version = model.name

    # -- caller side (any thread) -----------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="duplex-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._control.put(("wake", ()))
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def open(self, session_id: str, deliver: Deliver) -> None:
        with self._lock:
            admit(len(self._callers), self.load, self.config)
            if session_id in self._callers:
                raise KeyError(f"session {session_id} is already open")
            self._callers[session_id] = _Caller(Framer(self.model.input_chunk_samples), deliver)
        self._control.put(("open", (session_id,)))

    def push_audio(self, session_id: str, pcm: np.ndarray) -> None:
        """Float32 mono at model.input_rate; framed into encoder chunks here."""
        caller = self._callers[session_id]
        for chunk in caller.framer.push(pcm):
            self._control.put(("push", (session_id, chunk)))

    def push_frame(self, session_id: str, frame: np.ndarray) -> bool:
        """An RGB uint8 camera frame (H, W, 3), already sampled; False if the model has no eyes."""
        if not self.model.supports_video:
            return False
        self._control.put(("frame", (session_id, frame)))
        return True

    def push_text(self, session_id: str, text: str) -> bool:
        """User text into the Thinker context; False if the model takes no text."""
        if not self.model.accepts_text:
            return False
        self._control.put(("text", (session_id, text)))
        return True

    def commit(self, session_id: str, epoch: int) -> None:
        """Reply, in `epoch`, to everything pushed so far (a partial last chunk included)."""
        rest = self._callers[session_id].framer.flush()
        if len(rest):
            if not self.model.accepts_partial_chunks:
                rest = np.pad(rest, (0, self.model.input_chunk_samples - len(rest)))
            self._control.put(("push", (session_id, rest)))
        self._control.put(("commit", (session_id, epoch, time.monotonic())))

    def clear_input(self, session_id: str) -> None:
        self._callers[session_id].framer.flush()
        self._control.put(("clear", (session_id,)))

    def cancel(self, session_id: str, new_epoch: int) -> None:
        self._control.put(("cancel", (session_id, new_epoch)))

    def close(self, session_id: str) -> None:
        with self._lock:
            if self._callers.pop(session_id, None) is None:
                return
        self._control.put(("close", (session_id,)))

    def bytes_held(self, session_id: str) -> int:
        return self._bytes.get(session_id, 0)

    def total_bytes_held(self) -> int:
        return sum(list(self._bytes.values()))

    def bytes_by_session(self) -> dict[str, int]:
        return dict(self._bytes)

    def query(self, name: str) -> Any:
        """The result of the model's method `name` (no arguments), or None if it has none;
        for measurements such as `codec_stream_vs_offline`, run while the engine is idle."""
        method = getattr(self.model, name, None)
        return method() if callable(method) else None

    def drain_drops(self) -> list[Drop]:
        drops, self._drops = self._drops, []
        return drops

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Block until every control message so far has been applied (tests and shutdown)."""
        done = threading.Event()
        self._control.put(("barrier", (done,)))
        return done.wait(timeout_s)

    # -- worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        window_start = time.monotonic()
        window_busy = 0.0
        while not self._stopping.is_set():
            idle = not any(sq.response for sq in self.scheduler.sessions.values())
            self._apply_control(block_s=0.05 if idle else 0.002)
            start = time.monotonic()
            plan = self.scheduler.schedule(start)
            if not plan.empty:
                try:
                    self._step(plan, start)
                except Exception as exc:
                    log.exception("engine step failed; closing the sessions in it")
                    failed = {e.session_id for b in plan.batches for e in b.entries}
                    failed |= {e.session_id for e in plan.begin}
                    for sid in failed:
                        caller = self._callers.get(sid)
                        if caller is not None:
                            caller.deliver(SessionFailed(sid, f"{type(exc).__name__}: {exc}"))
                        self._control.put(("close", (sid,)))
                window_busy += time.monotonic() - start
            self._collect_drops()
            now = time.monotonic()
            if now - window_start >= 1.0:
                self.load = 0.5 * self.load + 0.5 * window_busy / (now - window_start)
                self.stats.busy_s += window_busy
                window_start, window_busy = now, 0.0
        for sid in list(self._states):
            self._free(sid)

    def _apply_control(self, block_s: float) -> None:
        try:
            op, args = self._control.get(timeout=block_s)
        except queue.Empty:
            return
        while True:
            self._apply_one(op, args)
            try:
                op, args = self._control.get_nowait()
            except queue.Empty:
                return

    def _apply_one(self, op: str, args: tuple[Any, ...]) -> None:
        if op == "open":
            (sid,) = args
            try:
                self.scheduler.add_session(sid)
            except EngineFull:
                log.error("session %s admitted but no slot is free", sid)
                return
            self._states[sid] = self.model.new_state(sid)
        elif op == "close":
            (sid,) = args
            if sid in self._states:
                self.scheduler.remove_session(sid)
                self._free(sid)
        elif op == "barrier":
            args[0].set()
        elif args and args[0] not in self._states:
            return
        elif op == "push":
            sid, chunk = args
            self.scheduler.push_input(sid, chunk, time.monotonic(), self.version)
            self._refresh_bytes(sid)
        elif op == "frame":
            sid, frame = args
            self.scheduler.push_frame(sid, frame, time.monotonic(), self.version)
            self._refresh_bytes(sid)
        elif op == "text":
            sid, text = args
            self.scheduler.push_text(sid, text, time.monotonic(), self.version)
        elif op == "commit":
            self.scheduler.commit(*args)
        elif op == "clear":
            (sid,) = args
            self.scheduler.clear_input(sid)
            self.model.clear_input(self._states[sid])
            self._refresh_bytes(sid)
        elif op == "cancel":
            sid, epoch = args
            if epoch > self.scheduler.sessions[sid].epoch:
                self.scheduler.cancel(sid, epoch)
                self.model.reset_response(self._states[sid])
                self._refresh_bytes(sid)

    def _free(self, sid: str) -> None:
        state = self._states.pop(sid)
        self.model.free(state)
        left = self.model.bytes_held(state)
        if left:
            log.error("model still holds %d bytes of session %s after free", left, sid)
        self._bytes.pop(sid, None)

    def _refresh_bytes(self, sid: str) -> None:
        sq = self.scheduler.sessions.get(sid)
        if sq is not None:
            self._bytes[sid] = self.model.bytes_held(self._states[sid]) + sq.queued_bytes()

    def _collect_drops(self) -> None:
        if self.scheduler.drops:
            self._drops.extend(self.scheduler.drops)
            self.scheduler.drops.clear()

    def _step(self, plan: StepPlan, start: float) -> None:
        for e in plan.begin:
            self.model.begin_response(self._states[e.session_id])
        results: dict[Stage, list[Any]] = {}
        for batch in plan.batches:
            st = self.stats.stages[batch.stage.value]
            for e in batch.entries:
                if e.payload is not None:
                    st.queue_ms.append((start - e.payload.enqueued_at) * 1000)
            groups = [batch.entries] if self.config.batching else [(e,) for e in batch.entries]
            out: list[Any] = []
            for entries in groups:
                t0 = time.monotonic()
                out += self._call(batch.stage, entries)
                st.compute_ms.append((time.monotonic() - t0) * 1000)
                st.batch_sizes.append(len(entries))
            results[batch.stage] = out
        now = time.monotonic()
        for event in self.scheduler.update(plan, results, now, self.version):
            caller = self._callers.get(event.session_id)
            if caller is not None:
                caller.deliver(event)
        for sid in {e.session_id for b in plan.batches for e in b.entries}:
            self._refresh_bytes(sid)

    def _call(self, stage: Stage, entries) -> list[Any]:
        m = self.model
        states = [self._states[e.session_id] for e in entries]
        if stage is Stage.ENCODE:
            return m.encode_audio(states, [e.payload.data for e in entries])
        if stage is Stage.VISION:
            return m.encode_video(states, [e.payload.data for e in entries])
        if stage is Stage.PREFILL:
            m.thinker_prefill(states, [e.payload.data for e in entries])
            return [None] * len(entries)
        if stage is Stage.THINKER:
            return m.thinker_decode(states)
        if stage is Stage.TALKER:
            return m.talker_step(states, [e.payload.data if e.payload else None for e in entries])
        return m.codec_decode(states, [e.payload.data for e in entries])
