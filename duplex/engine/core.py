"""The engine core: one worker thread that applies requests in order, plans a step, runs each
stage as one batched model call across sessions, and emits what comes out.

It knows nothing of callers: requests arrive through `submit` (from any thread), outputs leave
through the `emit` callable it was given, on the worker thread. Admission, framing and the
bytes-held mirror are the caller side's (client.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from duplex.engine import messages as m
from duplex.engine.lockstep import Lockstep
from duplex.engine.payload import Kind, Payload
from duplex.engine.scheduler import (
    EngineFull,
    Entry,
    Scheduler,
    SchedulerConfig,
    SessionFailed,
    Stage,
    StageResults,
    StepPlan,
)
from duplex.engine.stats import EngineStats
from duplex.engine.timing import StageClock
from models.base import DuplexModel, ModelState

log = logging.getLogger("duplex.engine")

REPORT_S = 0.25
"""How often the core reports what it holds, besides after every barrier."""


@dataclass
class EngineConfig:
    max_sessions: int = 64
    max_load: float = 0.85
    """Busy fraction of the engine loop above which new sessions are refused."""
    batching: bool = True
    """False runs one model call per session per stage: the per-session baseline."""
    scheduler: SchedulerConfig | None = None
    duplex_max_lag_ms: int = 400
    """A duplex session further behind its input than this drops frames and resyncs."""


class PayloadMismatch(Exception):
    """A payload reached a stage it was not made for: another model version, or data of the
    wrong type. Computing on it would give a wrong answer quietly; the sessions fail instead."""


_INPUT_DTYPES = {Kind.PCM_IN: "float32", Kind.FRAME_IN: "uint8"}


class EngineCore:
    def __init__(self, model: DuplexModel, config: EngineConfig,
                 emit: Callable[[m.Output], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: the engine's time (due frames, waits, costs), injectable for tests."""
        self.model = model
        self.clock = clock
        self.config = config
        self.emit = emit
        base = config.scheduler or SchedulerConfig()
        self.scheduler = Scheduler(config.max_sessions, replace(
            base, output_rate=model.output_rate,
            token_lead=min(base.token_lead, model.max_thinker_lead)))
        self.version = model.name
        self.stats = EngineStats()
        self.stage_clock = StageClock(model.device, clock)
        self.load = 0.0
        self._states: dict[str, ModelState] = {}
        self._requests: queue.SimpleQueue[m.Request | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._last_report = 0.0
        self.lockstep = (
            Lockstep(model, config.duplex_max_lag_ms, self.stats, config.batching, clock,
                     self.stage_clock)
            if model.duplex_delay_frames else None
        )
        largest = min(self.scheduler.config.max_batch, config.max_sessions)
        self.startup = model.warm_up(largest if config.batching else 1)
        """What the model prepared and checked before serving (`DuplexModel.warm_up`)."""

    # -- any thread -------------------------------------------------------------------------

    def submit(self, request: m.Request) -> None:
        self._requests.put(request)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="duplex-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._requests.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- worker thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("the engine core stopped")
            self._report(alive=False)
        finally:
            for sid in list(self._states):
                self._free(sid)

    def _loop(self) -> None:
        window_start = self.clock()
        window_busy = 0.0
        while not self._stopping.is_set():
            idle = not any(sq.response for sq in self.scheduler.sessions.values())
            self._apply_requests(block_s=self._duplex_wait(0.05 if idle else 0.002))
            start, cpu_start = self.clock(), time.thread_time()
            plan = self.scheduler.schedule(start)
            if not plan.empty:
                try:
                    self._step(plan, start)
                except Exception as exc:
                    log.exception("engine step failed; closing the sessions in it")
                    self._fail(plan, f"{type(exc).__name__}: {exc}")
                # The CPU interval lies within the wall one, so the share never passes 1.
                cpu = time.thread_time() - cpu_start
                busy = self.clock() - start
                window_busy += busy
                self.stats.busy_s += busy
                self.stats.busy_cpu_s += cpu
                self.stats.steps += 1
            window_busy += self._duplex_tick()
            now = self.clock()
            if now - window_start >= 1.0:
                self.load = 0.5 * self.load + 0.5 * window_busy / (now - window_start)
                window_start, window_busy = now, 0.0
            if now - self._last_report >= REPORT_S:
                self._report()

    def _fail(self, plan: StepPlan, message: str) -> None:
        failed = {e.session_id for b in plan.batches for e in b.entries}
        failed |= {e.session_id for e in plan.begin}
        for sid in failed:
            self.emit(SessionFailed(sid, message))
            self._close(m.CloseSession(sid))

    def _report(self, alive: bool = True) -> None:
        self._last_report = self.clock()
        self.stage_clock.collect(wait=True)
        drops, self.scheduler.drops = self.scheduler.drops, []
        lockstep = self.lockstep
        if lockstep is not None:
            drops, lockstep.drops = drops + lockstep.drops, []
        # A core dying of an error frees every session next; its last report holds none.
        self.emit(m.Report(self._bytes_held() if alive else {}, drops, self.stats.take(),
                           self.load, self.stats.busy_s, self.stats.steps, alive,
                           self.model.cache_stats(), lockstep.cost() if lockstep else None,
                           busy_cpu_s=self.stats.busy_cpu_s, kv=self.model.kv_stats(),
                           sessions=len(self._states), graphs=self.model.graph_stats()))

    def _bytes_held(self) -> dict[str, int]:
        """What each session holds, counted when a report goes out (not after every step and
        request): reports are the only place anyone reads it."""
        held = {}
        for sid, state in self._states.items():
            sq = self.scheduler.sessions.get(sid)
            queued = sq.queued_bytes() if sq else 0
            if self.lockstep is not None:
                queued += self.lockstep.queued_bytes(sid)
            held[sid] = self.model.bytes_held(state) + queued
        return held

    def _apply_requests(self, block_s: float) -> None:
        try:
            request = self._requests.get(timeout=block_s)
        except queue.Empty:
            return
        while request is not None:
            # A request for a session closed (or never opened) on its way here is moot.
            if not isinstance(request, m.SESSION_REQUESTS) or request.session_id in self._states:
                try:
                    _APPLY[type(request)](self, request)
                except Exception:
                    # One bad request must not take every session's engine down with it.
                    log.exception("engine: %s failed", type(request).__name__)
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return

    def _open(self, r: m.OpenSession) -> None:
        try:
            self.scheduler.add_session(r.session_id)
        except (EngineFull, KeyError) as exc:
            self.emit(SessionFailed(r.session_id, str(exc)))
            return
        self._states[r.session_id] = self.model.new_state(r.session_id)

    def _close(self, r: m.CloseSession) -> None:
        if r.session_id in self._states:
            if self.lockstep is not None:
                self.lockstep.leave(r.session_id)
            self.scheduler.remove_session(r.session_id)
            self._free(r.session_id)

    def _push_audio(self, r: m.PushAudio) -> None:
        if self.lockstep is not None and r.session_id in self.lockstep.slots:
            self.lockstep.push(r.session_id, r.pcm, self.clock())
            return
        self.scheduler.push_input(r.session_id, r.pcm, self.clock(), self.version)

    def _push_frame(self, r: m.PushFrame) -> None:
        self.scheduler.push_frame(r.session_id, r.frame, self.clock(), self.version)

    def _push_text(self, r: m.PushText) -> None:
        self.scheduler.push_text(r.session_id, r.turn, self.clock(), self.version)

    def _instruct(self, r: m.Instruct) -> None:
        self.model.instruct(self._states[r.session_id], r.instructions, r.tools)

    def _commit(self, r: m.Commit) -> None:
        self.scheduler.commit(r.session_id, r.epoch, r.at, r.spec)

    def _clear_input(self, r: m.ClearInput) -> None:
        self.scheduler.clear_input(r.session_id)
        if self.lockstep is not None:
            self.lockstep.clear(r.session_id)
        self.model.clear_input(self._states[r.session_id])

    def _cancel(self, r: m.CancelReply) -> None:
        if r.new_epoch > self.scheduler.sessions[r.session_id].epoch:
            self.scheduler.cancel(r.session_id, r.new_epoch)
            if self.lockstep is not None and r.session_id in self.lockstep.slots:
                # A duplex model keeps listening and its streams go on: only output is fenced.
                self.lockstep.cancel(r.session_id, r.new_epoch)
                return
            self.model.reset_response(self._states[r.session_id])

    def _set_duplex(self, r: m.SetDuplex) -> None:
        if self.lockstep is None:
            self.emit(SessionFailed(r.session_id, f"model {self.version} has no duplex mode"))
            return
        if r.on:
            sq = self.scheduler.sessions[r.session_id]
            self.lockstep.join(r.session_id, sq.epoch, sq.input_samples)
        else:
            self.lockstep.leave(r.session_id, "mode_changed")

    def _duplex_wait(self, block_s: float) -> float:
        """How long to wait for requests: no later than the next duplex frame is due."""
        due = self.lockstep.next_due() if self.lockstep is not None else None
        return block_s if due is None else max(0.0, min(block_s, due - self.clock()))

    def _duplex_tick(self) -> float:
        """Step the due duplex sessions; the seconds it took."""
        if self.lockstep is None:
            return 0.0
        start = self.clock()
        try:
            events = self.lockstep.step(self._states, start)
        except Exception as exc:
            log.exception("duplex step failed; closing its sessions")
            for sid in list(self.lockstep.slots):
                self.emit(SessionFailed(sid, f"{type(exc).__name__}: {exc}"))
                self._close(m.CloseSession(sid))
            return self.clock() - start
        self.stage_clock.collect()
        if events:
            self.emit(m.StepEvents(tuple(events)))
        return self.clock() - start if events else 0.0

    def _barrier(self, r: m.Barrier) -> None:
        self._report()
        self.emit(m.Reply(r.token, True))

    def _query(self, r: m.Query) -> None:
        try:
            self.emit(m.Reply(r.token, r.fn(self.model)))
        except Exception as exc:
            self.emit(m.Reply(r.token, None, f"{type(exc).__name__}: {exc}"))

    def _free(self, sid: str) -> None:
        state = self._states.pop(sid)
        self.model.free(state)
        left = self.model.bytes_held(state)
        if left:
            log.error("model still holds %d bytes of session %s after free", left, sid)

    # -- one step -------------------------------------------------------------------------

    def _step(self, plan: StepPlan, start: float) -> None:
        for e in plan.begin:
            spec = self.scheduler.sessions[e.session_id].response.spec
            self.model.begin_response(self._states[e.session_id], spec)
        results = StageResults()
        for batch in plan.batches:
            st = self.stats.stages[batch.stage.value]
            for e in batch.entries:
                if e.payload is not None:
                    st.queue_ms.append((start - e.payload.enqueued_at) * 1000)
            groups = [batch.entries] if self.config.batching else [(e,) for e in batch.entries]
            out: list[Any] = []
            for entries in groups:
                with self.stage_clock.timed(st.compute_ms):
                    out += self._call(batch.stage, entries)
                st.batch_sizes.append(len(entries))
            results.put(batch.stage, out)
        self.stage_clock.collect()
        events = self.scheduler.update(plan, results, self.clock(), self.version)
        if events:
            self.emit(m.StepEvents(tuple(events)))

    def _call(self, stage: Stage, entries: tuple[Entry, ...]) -> list[Any]:
        model = self.model
        states = [self._states[e.session_id] for e in entries]
        if stage is Stage.THINKER:
            return model.thinker_decode(states)
        if stage is Stage.TALKER:
            return model.talker_step(states, [self._data(e.payload) if e.payload else None
                                              for e in entries])
        data = [self._data(e.payload) for e in entries]
        if stage is Stage.ENCODE:
            return model.encode_audio(states, data)
        if stage is Stage.VISION:
            return model.encode_video(states, data)
        if stage is Stage.PREFILL:
            model.thinker_prefill(states, data)
            return [None] * len(entries)
        return model.codec_decode(states, data)

    def _data(self, p: Payload) -> Any:
        if p.version != self.version:
            raise PayloadMismatch(f"a {p.kind} payload of model {p.version!r} reached model "
                                  f"{self.version!r}")
        expected = _INPUT_DTYPES.get(p.kind)
        if expected is not None and p.dtype != expected:
            raise PayloadMismatch(f"a {p.kind} payload holds {p.dtype}, not {expected}")
        return p.data


_APPLY: dict[type, Callable[[EngineCore, Any], None]] = {
    m.OpenSession: EngineCore._open,
    m.CloseSession: EngineCore._close,
    m.PushAudio: EngineCore._push_audio,
    m.PushFrame: EngineCore._push_frame,
    m.PushText: EngineCore._push_text,
    m.Instruct: EngineCore._instruct,
    m.Commit: EngineCore._commit,
    m.ClearInput: EngineCore._clear_input,
    m.CancelReply: EngineCore._cancel,
    m.Barrier: EngineCore._barrier,
    m.Query: EngineCore._query,
    m.SetDuplex: EngineCore._set_duplex,
}
