"""The caller's side of an engine, whichever carries its requests.

Sessions talk to an `EngineClient`: it admits them, frames their audio into encoder chunks,
turns each call into a typed request (messages.py) for the core, and routes the core's outputs
back: per-session events to the session's `deliver`, reports into the bytes-held mirror, the
drops and the stage statistics, replies to whoever waits on them. Subclasses only say how a
request reaches the core: `Engine` (engine.py) hands it to a core on a thread of this process,
`EngineProcess` (process.py) sends it down a pipe to a core in a process of its own.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.engine import messages as m
from duplex.engine.core import EngineConfig
from duplex.engine.lockstep import TickCost, admit_duplex
from duplex.engine.scheduler import Drop, SessionFailed
from duplex.engine.stats import EngineStats
from duplex.media import Framer
from models.base import KVStats, Mark, ReplyTurn, Rewind, TextTurn
from models.caches import CacheStats
from models.reply import ReplySpec

log = logging.getLogger("duplex.engine")
Deliver = Callable[[m.SessionEvent], None]


class AdmissionRefused(Exception):
    """A new session would push the engine past real time; `limit` names the setting."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


def admit(n_open: int, load: float, config: EngineConfig,
          kv: dict[str, KVStats] | None = None, unreported: int = 0) -> None:
    """Raise AdmissionRefused if one more session would pass a limit; `load` is the measured
    busy fraction with `n_open` sessions, `kv` the KV pools as last reported, before
    `unreported` sessions opened since."""
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
    for stage, pool in (kv or {}).items():
        if pool.sessions_admissible - unreported <= 0:
            raise AdmissionRefused(
                f"KV memory is full: the {stage} pool has {pool.blocks_free} of "
                f"{pool.blocks_total} blocks free beside what open sessions hold, and a "
                f"session needs {pool.session_blocks} (limit engine.kv_memory)",
                "engine.kv_memory",
            )


@dataclass(frozen=True)
class ModelInfo:
    """What callers need to know of the model, wherever it lives."""

    name: str
    device: str
    dtype: str
    input_rate: int
    output_rate: int
    supports_video: bool
    accepts_text: bool
    accepts_partial_chunks: bool
    input_chunk_samples: int
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    duplex_delay_frames: int | None = None
    """Native full duplex: the model's fixed delay in frames; None for turns only."""
    restores_context: bool = False
    rewinds_context: bool = False
    startup: dict[str, Any] = field(default_factory=dict)
    """What the model prepared and checked before serving (`DuplexModel.warm_up`)."""

    @classmethod
    def of(cls, model, startup: dict[str, Any] | None = None) -> ModelInfo:
        return cls(model.name, model.device, model.dtype, model.input_rate, model.output_rate,
                   model.supports_video, model.accepts_text, model.accepts_partial_chunks,
                   model.input_chunk_samples, tuple(model.voices), model.default_voice,
                   model.duplex_delay_frames, model.restores_context, model.rewinds_context,
                   startup or {})


@dataclass
class _Waiter:
    """A caller blocked on the core's reply to one barrier or query."""

    done: threading.Event = field(default_factory=threading.Event)
    reply: m.Reply | None = None


def _nobody(event: m.SessionEvent) -> None:
    """Where a parked session's events go."""


class EngineClient(ABC):
    model: ModelInfo

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.stats = EngineStats()
        self.load = 0.0
        self._callers: dict[str, Deliver] = {}
        self._framers: dict[str, Framer] = {}
        self._bytes: dict[str, int] = {}
        self._drops: list[Drop] = []
        self._waiters: dict[int, _Waiter] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._gone: str | None = None
        """Why the core can no longer be reached; None while it can."""
        self._core_alive = True
        self.cache_stats: dict[str, CacheStats] = {}
        """The model's cache counters as of the core's last report."""
        self.kv_stats: dict[str, KVStats] = {}
        """The model's paged KV pools as of the core's last report."""
        self.graph_stats: dict[str, dict[str, int]] = {}
        """The model's decode steps by how they ran (graph replays, eager), as of the core's
        last report."""
        self._core_sessions = 0
        self.duplex_tick: TickCost | None = None
        self._duplex: set[str] = set()

    # -- how requests travel (subclasses) ---------------------------------------------------

    @abstractmethod
    def _submit(self, request: m.Request) -> None: ...

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> None: ...

    @property
    def alive(self) -> bool:
        return self._gone is None and self._core_alive

    # -- sessions ---------------------------------------------------------------------------

    def open(self, session_id: str, deliver: Deliver) -> None:
        with self._lock:
            if self._gone is not None:
                raise AdmissionRefused(f"engine process is not running ({self._gone})",
                                       "engine.process")
            self.admit()
            if session_id in self._callers:
                raise KeyError(f"session {session_id} is already open")
            self._callers[session_id] = deliver
            self._framers[session_id] = Framer(self.model.input_chunk_samples)
        self._submit(m.OpenSession(session_id))

    def admit(self) -> None:
        """Raise AdmissionRefused if one more session would pass a limit now."""
        n_open = len(self._callers)
        admit(n_open, self.load, self.config, self.kv_stats,
              max(0, n_open - self._core_sessions))

    def push_audio(self, session_id: str, pcm: np.ndarray) -> None:
        """Float32 mono at model.input_rate; framed here, so the core takes one request per
        encoder chunk rather than one per network frame."""
        framer = self._framer(session_id)
        for chunk in framer.push(pcm) if framer is not None else ():
            self._submit(m.PushAudio(session_id, chunk))

    def push_frame(self, session_id: str, frame: np.ndarray) -> bool:
        """An RGB uint8 camera frame (H, W, 3), already sampled; False if the model has no eyes."""
        if not self.model.supports_video:
            return False
        if self._check_open(session_id):
            self._submit(m.PushFrame(session_id, frame))
        return True

    def push_text(self, session_id: str, text: str, role: str = "user") -> bool:
        """Text into the Thinker context (the user's, or a tool's output); False if the model
        takes no text."""
        if not self.model.accepts_text:
            return False
        if self._check_open(session_id):
            self._submit(m.PushText(session_id, TextTurn(text, role)))
        return True

    def push_reply(self, session_id: str, turn: ReplyTurn) -> None:
        """A reply as it was heard, back into the Thinker context (a rebuild after a resume).
        The audio before it ends its turn as a commit would end it: the last chunk padded."""
        framer = self._framer(session_id)
        if framer is None or not self.model.restores_context:
            return
        self._flush(session_id, framer)
        self._submit(m.PushText(session_id, turn))

    def mark(self, session_id: str, key: int) -> None:
        """An item boundary in the model's context; the audio before it ends there (its last
        chunk padded as a commit pads it)."""
        framer = self._framer(session_id)
        if framer is None or not self.model.rewinds_context:
            return
        self._flush(session_id, framer)
        self._submit(m.PushText(session_id, Mark(key)))

    def rewind(self, session_id: str, key: int,
               system: tuple[str, tuple[dict[str, Any], ...]] | None = None) -> None:
        """The model's context back to the boundary `key` (where it reaches the head, opened
        again with `system`: instructions and tools); audio not yet framed is dropped with
        what follows it."""
        framer = self._framer(session_id)
        if framer is None or not self.model.rewinds_context:
            return
        framer.flush()
        self._submit(m.PushText(session_id, Rewind(key, system)))

    def instruct(self, session_id: str, instructions: str,
                 tools: tuple[dict[str, Any], ...]) -> None:
        if self._check_open(session_id):
            self._submit(m.Instruct(session_id, instructions, tools))

    def commit(self, session_id: str, epoch: int, spec: ReplySpec | None = None) -> None:
        """Reply, in `epoch`, to everything pushed so far (a partial last chunk included), as
        `spec` asks."""
        at = time.monotonic()
        framer = self._framer(session_id)
        if framer is None:
            return
        self._flush(session_id, framer)
        self._submit(m.Commit(session_id, epoch, at, spec or ReplySpec()))

    def _flush(self, session_id: str, framer: Framer) -> None:
        rest = framer.flush()
        if len(rest):
            if not self.model.accepts_partial_chunks:
                rest = np.pad(rest, (0, self.model.input_chunk_samples - len(rest)))
            self._submit(m.PushAudio(session_id, rest))

    def clear_input(self, session_id: str) -> None:
        framer = self._framer(session_id)
        if framer is not None:
            framer.flush()
            self._submit(m.ClearInput(session_id))

    def set_duplex(self, session_id: str, on: bool) -> None:
        """Run the session as native full duplex (on) or turn by turn; raises
        AdmissionRefused when one more duplex session would not fit the frame budget."""
        if not self._check_open(session_id):
            return
        with self._lock:
            if on and session_id not in self._duplex:
                frame_ms = 1000 * self.model.input_chunk_samples / self.model.input_rate
                why = admit_duplex(self.duplex_tick, len(self._duplex), frame_ms,
                                   self.config.max_load)
                if why is not None:
                    raise AdmissionRefused(why, "engine.max_load")
            (self._duplex.add if on else self._duplex.discard)(session_id)
        self._submit(m.SetDuplex(session_id, on))

    def cancel(self, session_id: str, new_epoch: int) -> None:
        self._submit(m.CancelReply(session_id, new_epoch))

    def park(self, session_id: str) -> None:
        """Keep the session's state with nobody listening (its connection dropped); `adopt`
        gives it a listener again, `close` releases it."""
        with self._lock:
            if session_id in self._callers:
                self._callers[session_id] = _nobody

    def adopt(self, session_id: str, deliver: Deliver) -> bool:
        """Deliver a parked session's events to `deliver`; False if it is gone."""
        with self._lock:
            if self._gone is not None or self._callers.get(session_id) is not _nobody:
                return False
            self._callers[session_id] = deliver
            return True

    def close(self, session_id: str) -> None:
        with self._lock:
            if self._callers.pop(session_id, None) is None:
                return
            self._framers.pop(session_id, None)
            self._duplex.discard(session_id)
        self._submit(m.CloseSession(session_id))

    def _check_open(self, session_id: str) -> bool:
        """True for an open session; False once the core is gone (its sessions have been told
        with SessionFailed, and calls still on their way from them are moot); KeyError for a
        session never opened or already closed."""
        if self._gone is not None:
            return False
        if session_id not in self._callers:
            raise KeyError(f"session {session_id} is not open")
        return True

    def _framer(self, session_id: str) -> Framer | None:
        return self._framers[session_id] if self._check_open(session_id) else None

    # -- what the core reported -------------------------------------------------------------

    def bytes_held(self, session_id: str) -> int:
        return self._bytes.get(session_id, 0)

    def total_bytes_held(self) -> int:
        return sum(self._bytes.values())

    def bytes_by_session(self) -> dict[str, int]:
        return dict(self._bytes)

    def drain_drops(self) -> list[Drop]:
        drops, self._drops = self._drops, []
        return drops

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Block until the core has applied every request so far and reported after it."""
        reply = self._ask(lambda token: m.Barrier(token), timeout_s)
        return reply is not None

    def query(self, fn: Callable[[Any], Any], timeout_s: float = 600.0) -> Any:
        """`fn(model)` run where the model lives (a module-level function); its result."""
        name = getattr(fn, "__qualname__", repr(fn))
        reply = self._ask(lambda token: m.Query(token, fn), timeout_s)
        if self._gone is not None:
            raise RuntimeError(f"engine process is not running ({self._gone})")
        if reply is None:
            raise TimeoutError(f"the engine did not answer {name} in {timeout_s:.0f} s")
        if reply.error is not None:
            raise RuntimeError(f"{name} failed in the engine: {reply.error}")
        return reply.value

    def _ask(self, request: Callable[[int], m.Request], timeout_s: float) -> m.Reply | None:
        token = next(self._tokens)
        waiter = _Waiter()
        # Registered before the check, so a core lost in between still wakes this wait.
        self._waiters[token] = waiter
        if self._gone is None:
            self._submit(request(token))
            waiter.done.wait(timeout_s)
        self._waiters.pop(token, None)
        return waiter.reply if self._gone is None else None

    # -- outputs (on the core's thread, or the pipe reader's) -------------------------------

    def _on_output(self, output: m.Output) -> None:
        if isinstance(output, m.Report):
            self._bytes = output.bytes_by_session
            self._drops.extend(output.drops)
            self.stats.add(output.stage_samples)
            self.load, self.stats.busy_s, self.stats.steps, self._core_alive = (
                output.load, output.busy_s, output.steps, output.alive)
            self.stats.busy_cpu_s = output.busy_cpu_s
            self.cache_stats = output.caches
            self.kv_stats, self._core_sessions = output.kv, output.sessions
            self.graph_stats = output.graphs
            self.duplex_tick = output.duplex_tick
        elif isinstance(output, m.Reply):
            waiter = self._waiters.get(output.token)
            if waiter is not None:
                waiter.reply = output
                waiter.done.set()
        elif isinstance(output, m.StepEvents):
            for event in output.events:
                self._deliver(event)
        else:
            self._deliver(output)

    def _deliver(self, event: m.SessionEvent) -> None:
        deliver = self._callers.get(event.session_id)
        if deliver is not None:
            try:
                deliver(event)
            except Exception:
                log.exception("an engine event for %s could not be delivered", event.session_id)

    def _core_lost(self, reason: str, *, expected: bool) -> None:
        """The core can no longer be reached: fail its sessions, wake every waiter."""
        self._gone = reason
        with self._lock:
            callers, self._callers = self._callers, {}
            self._framers = {}
        if not expected:
            log.error("engine %s; failing its sessions", reason)
            for sid, deliver in callers.items():
                deliver(SessionFailed(sid, f"the engine {reason}"))
        self._bytes = {}
        for waiter in list(self._waiters.values()):
            waiter.done.set()
