"""The engine in a process of its own, behind the same calling surface as `Engine`.

With a small model a step is mostly Python (module calls, cache bookkeeping), and one process
runs Python on one core at a time: in-process, the engine thread, the event loop and the VAD
take turns on that lock, and the two-core machine serves little more than one core's worth of
sessions. Here a child process owns the model and an ordinary `Engine`; the parent keeps what
callers touch (admission, the session table, the bytes-held mirror, stage statistics) and
talks to it over a pipe. Calls go down in batches from a sender thread, so the event loop never
waits on the pipe; results come back to a reader thread that delivers them as the engine thread
would; a report (bytes held, drops, stage samples, load) follows every REPORT_S and every
barrier. If the child dies, every open session gets SessionFailed and new ones are refused.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from duplex.engine.engine import AdmissionRefused, Deliver, Engine, EngineConfig, admit
from duplex.engine.scheduler import Drop, SessionFailed
from duplex.engine.stats import EngineStats
from duplex.media import Framer

log = logging.getLogger("duplex.engine")

REPORT_S = 0.25
SEND_GATHER_S = 0.003


class EngineStartFailed(Exception):
    """The child could not load the model; the message is the child's."""


@dataclass(frozen=True)
class ModelInfo:
    """What callers need to know of the model that lives in the child."""

    name: str
    device: str
    dtype: str
    input_rate: int
    output_rate: int
    supports_video: bool
    accepts_text: bool
    input_chunk_samples: int


@dataclass(frozen=True)
class ChildSpec:
    model_name: str
    cache_dir: str
    device: str
    config: EngineConfig
    torch_threads: int
    log_level: str | None = None
    log_format: str = "text"


class EngineProcess:
    def __init__(self, spec: ChildSpec, start_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.config = spec.config
        self.start_timeout_s = start_timeout_s
        self.model: ModelInfo | None = None
        self.stats = EngineStats()
        self.load = 0.0
        self._callers: dict[str, Deliver] = {}
        self._framers: dict[str, Framer] = {}
        self._bytes: dict[str, int] = {}
        self._drops: list[Drop] = []
        self._replies: dict[int, list[Any]] = {}
        self._tokens = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._gone: str | None = None
        self._engine_alive = True
        self._stopping = False
        self._proc = None
        self._conn = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the child and wait until its model is loaded; raises EngineStartFailed.

        A fresh interpreter rather than multiprocessing's spawn, which would re-run the
        caller's main script in the child (a script without a __main__ guard would recurse)."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from duplex.engine.process import child; child()",
             str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(self.spec)
        waited = 0.0
        while not self._conn.poll(0.5):
            waited += 0.5
            if self._proc.poll() is not None:
                raise EngineStartFailed(f"engine process exited with code {self._proc.returncode} "
                                        "while loading the model")
            if waited >= self.start_timeout_s:
                self._proc.kill()
                raise EngineStartFailed(f"engine process did not load the model in "
                                        f"{self.start_timeout_s:.0f} s")
        kind, *rest = self._conn.recv()
        if kind == "failed":
            self._proc.wait(timeout=5)
            raise EngineStartFailed(rest[0])
        self.model = rest[0]
        for target, name in ((self._read, "duplex-engine-reader"), (self._send, "duplex-engine-sender")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def alive(self) -> bool:
        return self.model is not None and self._gone is None and self._engine_alive

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        self._stopping = True
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("engine process did not stop; killing it")
                self._proc.kill()
                self._proc.wait(timeout=5)
        if self._conn is not None:
            self._conn.close()

    # -- the Engine surface -----------------------------------------------------------------

    def open(self, session_id: str, deliver: Deliver) -> None:
        with self._lock:
            if self._gone is not None:
                raise AdmissionRefused(f"engine process is not running ({self._gone})",
                                       "engine.process")
            admit(len(self._callers), self.load, self.config)
            if session_id in self._callers:
                raise KeyError(f"session {session_id} is already open")
            self._callers[session_id] = deliver
            self._framers[session_id] = Framer(self.model.input_chunk_samples)
        self._outbox.put(("open", session_id))

    def push_audio(self, session_id: str, pcm) -> None:
        # Framed here, so audio crosses the pipe one encoder chunk at a time rather than one
        # network frame at a time (50 messages a second per session).
        framer = self._framer(session_id)
        for chunk in framer.push(pcm) if framer else ():
            self._outbox.put(("push_audio", session_id, chunk))

    def push_frame(self, session_id: str, frame) -> bool:
        if not self.model.supports_video:
            return False
        if self._check_open(session_id):
            self._outbox.put(("push_frame", session_id, frame))
        return True

    def push_text(self, session_id: str, text: str) -> bool:
        if not self.model.accepts_text:
            return False
        if self._check_open(session_id):
            self._outbox.put(("push_text", session_id, text))
        return True

    def commit(self, session_id: str, epoch: int) -> None:
        framer = self._framer(session_id)
        if framer is None:
            return
        rest = framer.flush()
        if len(rest):
            self._outbox.put(("push_audio", session_id, rest))
        self._outbox.put(("commit", session_id, epoch))

    def clear_input(self, session_id: str) -> None:
        framer = self._framer(session_id)
        if framer is not None:
            framer.flush()
            self._outbox.put(("clear_input", session_id))

    def cancel(self, session_id: str, new_epoch: int) -> None:
        self._outbox.put(("cancel", session_id, new_epoch))

    def close(self, session_id: str) -> None:
        with self._lock:
            if self._callers.pop(session_id, None) is None:
                return
            self._framers.pop(session_id, None)
        self._outbox.put(("close", session_id))

    def bytes_held(self, session_id: str) -> int:
        return self._bytes.get(session_id, 0)

    def total_bytes_held(self) -> int:
        return sum(self._bytes.values())

    def drain_drops(self) -> list[Drop]:
        drops, self._drops = self._drops, []
        return drops

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Block until the child has applied every call so far and reported after it."""
        done, idle, _ = self._ask(("barrier", timeout_s), timeout_s + 1.0)
        return done and idle

    def query(self, name: str, timeout_s: float = 600.0) -> Any:
        """Call the model's method `name` (no arguments) in the child and return its result."""
        done, value, error = self._ask(("query", name), timeout_s)
        if self._gone is not None:
            raise RuntimeError(f"engine process is not running ({self._gone})")
        if not done:
            raise TimeoutError(f"the engine process did not answer {name} in {timeout_s:.0f} s")
        if error is not None:
            raise RuntimeError(f"{name} failed in the engine process: {error}")
        return value

    def _check_open(self, session_id: str) -> bool:
        """True for an open session; False once the child is gone (the session has been told
        with SessionFailed, and calls still on their way from it are moot); KeyError for a
        session never opened or already closed, as Engine raises."""
        if self._gone is not None:
            return False
        if session_id not in self._callers:
            raise KeyError(f"session {session_id} is not open")
        return True

    def _framer(self, session_id: str) -> Framer | None:
        return self._framers[session_id] if self._check_open(session_id) else None

    def _ask(self, message: tuple, timeout_s: float) -> tuple[bool, Any, str | None]:
        """Send `message` with a reply token; (answered, value, the child's error if any)."""
        token = next(self._tokens)
        slot: list[Any] = [threading.Event(), None, None]
        # Registered before the check, so a child dying in between still wakes this wait.
        self._replies[token] = slot
        if self._gone is None:
            self._outbox.put((message[0], token, *message[1:]))
            slot[0].wait(timeout_s)
        self._replies.pop(token, None)
        return slot[0].is_set() and self._gone is None, slot[1], slot[2]

    # -- pipe threads -----------------------------------------------------------------------

    def _send(self) -> None:
        while True:
            item = self._outbox.get()
            batch = [item]
            # Gather what follows for a moment: one write per SEND_GATHER_S instead of one per
            # call, and callers rarely find this thread waiting, so a put wakes nobody.
            time.sleep(SEND_GATHER_S)
            while item is not None:
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            stop = batch[-1] is None
            try:
                self._conn.send([m for m in batch if m is not None] + ([("stop",)] if stop else []))
            except OSError:
                return
            if stop:
                return

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._child_gone()
                return
            kind = message[0]
            if kind == "event":
                event = message[1]
                deliver = self._callers.get(event.session_id)
                if deliver is not None:
                    try:
                        deliver(event)
                    except Exception:
                        log.exception("an engine event for %s could not be delivered",
                                      event.session_id)
            elif kind == "report":
                self._bytes, drops, taken, self.load, self.stats.busy_s, self._engine_alive = (
                    message[1:])
                self._drops.extend(drops)
                self.stats.add(taken)
            elif kind == "reply":
                slot = self._replies.get(message[1])
                if slot is not None:
                    slot[1], slot[2] = message[2], message[3]
                    slot[0].set()

    def _child_gone(self) -> None:
        try:
            code = self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        self._gone = f"exited with code {code}" if code is not None else "pipe closed"
        with self._lock:
            callers, self._callers = self._callers, {}
            self._framers = {}
        if not self._stopping:
            log.error("engine process %s; failing its sessions", self._gone)
            for sid, deliver in callers.items():
                deliver(SessionFailed(sid, f"the engine process {self._gone}"))
        self._bytes = {}
        for slot in list(self._replies.values()):
            slot[0].set()


def child() -> None:
    """The engine process: argv[1] is its end of the socket to the parent."""
    # Ctrl-C reaches the whole process group; the parent decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    try:
        spec = conn.recv()
    except EOFError:
        return
    if spec.log_level is not None:
        from duplex.logs import configure

        configure(spec.log_level, spec.log_format)
    try:
        from duplex.engine.engine import set_torch_threads
        from models.registry import load_model

        set_torch_threads(spec.torch_threads)
        model = load_model(spec.model_name, spec.cache_dir, spec.device)
    except Exception as exc:
        conn.send(("failed", str(exc)))
        return
    # The parent admits sessions against the load this child reports; a second check here
    # could refuse a session the parent has already told its client about.
    engine = Engine(model, replace(spec.config, max_load=math.inf))
    send_lock = threading.Lock()

    def send(*messages: tuple) -> None:
        with send_lock:
            for message in messages:
                conn.send(message)

    def send_report(*then: tuple) -> None:
        # Taken and sent under one lock, so reports reach the parent in the order they were
        # taken and no two of them share or split the same samples.
        with send_lock:
            conn.send(("report", engine.bytes_by_session(), engine.drain_drops(),
                       engine.stats.take(), engine.load, engine.stats.busy_s, engine.alive))
            for message in then:
                conn.send(message)

    def deliver(event) -> None:
        try:
            send(("event", event))
        except OSError:
            pass

    stopped = threading.Event()

    def reporter() -> None:
        while not stopped.wait(REPORT_S):
            try:
                send_report()
            except OSError:
                return

    engine.start()
    send(("ready", ModelInfo(model.name, model.device, model.dtype, model.input_rate,
                             model.output_rate, model.supports_video, model.accepts_text,
                             model.input_chunk_samples)))
    threading.Thread(target=reporter, name="duplex-engine-reporter", daemon=True).start()
    try:
        _serve_calls(conn, engine, deliver, send, send_report)
    finally:
        stopped.set()
        engine.stop()


def _serve_calls(conn, engine: Engine, deliver, send, send_report) -> None:
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        for op, *args in batch:
            if op == "stop":
                return
            try:
                if op == "open":
                    engine.open(args[0], deliver)
                elif op == "barrier":
                    token, timeout_s = args
                    send_report(("reply", token, engine.wait_idle(timeout_s), None))
                elif op == "query":
                    token, name = args
                    try:
                        send(("reply", token, engine.query(name), None))
                    except Exception as exc:
                        send(("reply", token, None, f"{type(exc).__name__}: {exc}"))
                else:
                    getattr(engine, op)(*args)
            except (KeyError, AdmissionRefused) as exc:
                # A session the parent closed, or failed to open here, while calls for it
                # were on their way.
                if op == "open":
                    deliver(SessionFailed(args[0], str(exc)))
            except Exception:
                # One bad call must not take every session's engine down with it.
                log.exception("engine process: %s failed", op)


def start_engine(spec: ChildSpec, in_process: bool) -> Engine | EngineProcess:
    """A started engine: in a child process, or (in_process) on a thread of this one."""
    from duplex.engine.engine import set_torch_threads

    if not in_process:
        engine = EngineProcess(spec)
        engine.start()
        # What torch does here is the VAD's small forwards; more threads would only compete
        # with the engine process for the cores.
        set_torch_threads(1)
        return engine
    from models.registry import load_model

    set_torch_threads(spec.torch_threads)
    model = load_model(spec.model_name, spec.cache_dir, spec.device)
    engine = Engine(model, spec.config)
    engine.start()
    return engine
