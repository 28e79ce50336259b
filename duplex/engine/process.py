"""The engine in a process of its own, behind the same client as the in-process engine.

With a small model a step is mostly Python (module calls, cache bookkeeping), and one process
runs Python on one core at a time: in-process, the engine thread, the event loop and the VAD
take turns on that lock, and the two-core machine serves little more than one core's worth of
sessions. Here a child process owns the model and an `EngineCore`; the parent's client keeps
what callers touch and carries the same typed requests and outputs (messages.py) over a pipe.
Requests go down in batches from a sender thread, so the event loop never waits on the pipe;
outputs come back to a reader thread. If the child dies, every open session gets SessionFailed
and new ones are refused.

With `pin_cpus`, the child and this process also stop sharing cores: the child takes the last
of the CPUs this process may use, one per torch thread, and this process the rest. Sharing, a
stage call on the two-core machine waited for a core for about half of its wall time (the
bench's `engine_cpu_share`), while the sessions' audio, speech detection and events ran on it.
"""

from __future__ import annotations

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

from duplex.engine import messages as m
from duplex.engine.client import EngineClient, ModelInfo
from duplex.engine.core import EngineConfig, EngineCore
from models.caches import CacheBudgets

log = logging.getLogger("duplex.engine")

SEND_GATHER_S = 0.003


class EngineStartFailed(Exception):
    """The child could not load the model; the message is the child's."""


@dataclass(frozen=True)
class ChildSpec:
    model_name: str
    cache_dir: str
    device: str
    config: EngineConfig
    torch_threads: int
    log_level: str | None = None
    log_format: str = "text"
    caches: CacheBudgets = CacheBudgets()
    dtype: str = "auto"
    cuda_graphs: bool = False
    pin_cpus: bool = False
    kv_memory: float = 0.0
    """The KV pools' budget (`engine.kv_memory`)."""
    cpus: tuple[int, ...] = ()
    """The CPUs the child runs on (set by `EngineProcess.start` when pinning); empty: any."""


@dataclass(frozen=True)
class Ready:
    model: ModelInfo


@dataclass(frozen=True)
class StartFailed:
    message: str


@dataclass(frozen=True)
class Stop:
    """The parent is done: the child stops its core and exits."""


class EngineProcess(EngineClient):
    def __init__(self, spec: ChildSpec, start_timeout_s: float = 600.0) -> None:
        super().__init__(spec.config)
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.model: ModelInfo | None = None
        self._outbox: queue.SimpleQueue[m.Request | None] = queue.SimpleQueue()
        self._stopping = False
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._threads: list[threading.Thread] = []
        self._own_cpus: set[int] | None = None
        """This process's CPUs before pinning, given back on stop."""

    def start(self) -> None:
        """Start the child and wait until its model is loaded; raises EngineStartFailed.

        A fresh interpreter rather than multiprocessing's spawn, which would re-run the
        caller's main script in the child (a script without a __main__ guard would recurse)."""
        split = split_cpus(self.spec.torch_threads) if self.spec.pin_cpus else None
        if split is not None:
            self.spec = replace(self.spec, cpus=tuple(sorted(split[0])))
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
        started = self._conn.recv()
        if isinstance(started, StartFailed):
            # It has said why; tearing down an interpreter that imported torch can outlast
            # any wait on a loaded host, and the reason is what the caller must get.
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            raise EngineStartFailed(started.message)
        self.model = started.model
        if split is not None:
            self._pin_self(split[1])
        for target, name in ((self._read, "duplex-engine-reader"),
                             (self._send, "duplex-engine-sender")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    @property
    def alive(self) -> bool:
        return self.model is not None and super().alive

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _pin_self(self, cpus: set[int]) -> None:
        self._own_cpus = os.sched_getaffinity(0)
        _set_process_affinity(cpus)

    def stop(self) -> None:
        if self._own_cpus is not None:
            _set_process_affinity(self._own_cpus)
            self._own_cpus = None
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

    def _submit(self, request: m.Request) -> None:
        self._outbox.put(request)

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
                self._conn.send([r for r in batch if r is not None] + ([Stop()] if stop else []))
            except OSError:
                return
            if stop:
                return

    def _read(self) -> None:
        while True:
            try:
                output = self._conn.recv()
            except (EOFError, OSError):
                self._child_gone()
                return
            self._on_output(output)

    def _child_gone(self) -> None:
        try:
            code = self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        reason = f"process exited with code {code}" if code is not None else "process pipe closed"
        self._core_lost(reason, expected=self._stopping)


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
        from duplex.observability.logs import configure

        configure(spec.log_level, spec.log_format)
    if spec.cpus:
        os.sched_setaffinity(0, spec.cpus)  # before torch starts its threads: they inherit it
    try:
        from duplex.engine.engine import set_torch_threads

        set_torch_threads(spec.torch_threads)
        model = load_spec(spec)
    except Exception as exc:
        conn.send(StartFailed(str(exc)))
        return

    # Outputs leave through a writer thread of their own: pickling a step's PCM and writing it
    # (hundreds of kB at the maximum, more than the socket holds) waits on the parent's reader,
    # and the engine's thread would wait with it instead of starting the next step.
    outbox: queue.SimpleQueue[m.Output | Ready | None] = queue.SimpleQueue()
    writer = threading.Thread(target=_write, args=(conn, outbox), name="duplex-engine-writer",
                              daemon=True)
    # The parent admits sessions against the load this child reports; a second check here
    # could refuse a session the parent has already told its client about.
    core = EngineCore(model, replace(spec.config, max_load=math.inf), outbox.put)
    outbox.put(Ready(ModelInfo.of(model, core.startup)))
    writer.start()
    core.start()
    try:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                return
            for request in batch:
                if isinstance(request, Stop):
                    return
                core.submit(request)
    finally:
        core.stop()
        outbox.put(None)
        writer.join(timeout=10)


def _write(conn: Connection, outbox: queue.SimpleQueue) -> None:
    """Send what the core emits, in order, until None; the one writer of `conn`."""
    while (output := outbox.get()) is not None:
        try:
            conn.send(output)
        except OSError:
            return


def split_cpus(torch_threads: int) -> tuple[set[int], set[int]] | None:
    """(the engine's CPUs, this process's) from those this process may use: the engine gets
    one per torch thread, the last ones, and this process at least one. None where there are
    too few CPUs to split or the OS cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    from duplex.engine.engine import resolve_torch_threads

    allowed = sorted(os.sched_getaffinity(0))
    n = min(resolve_torch_threads(torch_threads), len(allowed) - 1)
    if n < 1:
        return None
    return set(allowed[-n:]), set(allowed[:-n])


def _set_process_affinity(cpus: set[int]) -> None:
    # Linux pins a thread, not a process: every thread running now, and threads started
    # later inherit their starter's.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def load_spec(spec: ChildSpec):
    from models.registry import load_model

    return load_model(
        spec.model_name, spec.cache_dir, spec.device, spec.dtype, spec.cuda_graphs, spec.caches,
        spec.kv_memory,
    )


def start_engine(spec: ChildSpec, in_process: bool) -> EngineClient:
    """A started engine: in a child process, or (in_process) on a thread of this one."""
    from duplex.engine.engine import Engine, set_torch_threads

    if not in_process:
        engine = EngineProcess(spec)
        engine.start()
        # What torch does here is the VAD's small forwards; more threads would only compete
        # with the engine process for the cores.
        set_torch_threads(1)
        return engine
    set_torch_threads(spec.torch_threads)
    model = load_spec(spec)
    engine = Engine(model, spec.config)
    engine.start()
    return engine
