"""Steps of fixed shape replayed as CUDA graphs, one graph per batch bucket, every one captured
when the engine starts (`warm_up`), never while serving (a capture stalls the GPU for a
fraction of a second).

A step is an object that allocates its tensors once for a batch size and whose `run` reads its
inputs from them and writes its outputs into them, with no host sync and no shape that depends
on the data: a graph of `run` then replays on whatever the buffers hold. The code predictor's
frame (`models.qwen3_omni.graphs`) and the Thinker's and Talker's decode steps
(`models.paged_static`) are such steps. A batch runs in the smallest bucket that holds it; the
rows past it are padding whose outputs nobody reads.

Where nothing is captured (the CPU, or `static_steps` for tests) the same buffers run eagerly,
so the CPU runs, and the tests check, everything a graph would hold but the replay itself.

Every graph of a model shares one memory pool: their intermediates are never live between
replays (each step copies its outputs into buffers allocated before any capture), so graphs
that never run at once may share it in any order (pytorch/pytorch#166975 says so of the
CUDA graph notes). Buckets are captured largest first: a smaller graph's intermediates then
fit in blocks the largest one left, and the pool costs about what the largest graph needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

log = logging.getLogger("duplex.models")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Batch sizes a graph is captured for; a batch runs in the smallest that holds it."""


def bucket(batch: int) -> int | None:
    """The smallest bucket that holds `batch` rows, or None past the largest."""
    return next((size for size in BUCKETS if size >= batch), None)


def capture_plan(max_batch: int) -> tuple[int, ...]:
    """The buckets to capture at start for calls of at most `max_batch` rows: every one up to
    the bucket that holds `max_batch` (all of them past the largest), largest first."""
    top = bucket(max_batch) or BUCKETS[-1]
    return tuple(size for size in reversed(BUCKETS) if size <= top)


class Step(Protocol):
    def run(self) -> None: ...


class GraphPool:
    """The memory pool every graph of one model shares, made at the first capture."""

    def __init__(self) -> None:
        self._handle = None

    @property
    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle


STEP_PATHS = ("replays", "static", "eager")
"""How a step can run: replayed as a graph, from the fixed buffers without a graph
(`static_steps`), or on the eager path."""


def step_counts() -> dict[str, int]:
    """A stage's steps by how they ran (`STEP_PATHS`), counted from zero."""
    return dict.fromkeys(STEP_PATHS, 0)


@dataclass(frozen=True)
class GraphSettings:
    """Whether steps run from fixed buffers (`static`) and whether those are captured as CUDA
    graphs (`capture`, only on a CUDA device), with the pool the graphs share."""

    static: bool = False
    capture: bool = False
    pool: GraphPool | None = field(default=None, compare=False)


def graph_settings(cuda_graphs: bool, static_steps: bool, device) -> GraphSettings:
    """`cuda_graphs` captures on a CUDA device and does nothing elsewhere; `static_steps` runs
    the fixed buffers without capturing (what the CPU tests check against the eager path)."""
    if cuda_graphs and torch.device(device).type == "cuda":
        return GraphSettings(static=True, capture=True, pool=GraphPool())
    if cuda_graphs:
        log.info("engine.cuda_graphs is on but the model is on %s: nothing is captured", device)
    return GraphSettings(static=static_steps)


class BucketGraphs:
    """A step's fixed-buffer runners, one per bucket, each captured as a CUDA graph at
    `warm_up` when `capture`.

    A batch that `holds` says no bucket takes runs elsewhere (the eager path): one past the
    largest bucket prepared, or any batch once a capture has failed (logged once; the eager
    path stays correct).
    """

    def __init__(self, name: str, make: Callable[[int], Step], capture: bool = True,
                 pool: GraphPool | None = None) -> None:
        self.name = name
        self._make = make
        self.capture = capture
        self.pool = pool if pool is not None or not capture else GraphPool()
        self._static: dict[int, Step] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_ms: dict[int, float] = {}
        """Per bucket, the host's time to build, warm up and capture it."""
        self.failed = False

    @property
    def ready(self) -> tuple[int, ...]:
        """The buckets a batch may run in (captured ones, when capturing)."""
        return tuple(sorted(self._graphs if self.capture else self._static))

    def warm_up(self, max_batch: int) -> tuple[int, ...]:
        """Prepare every bucket a call of at most `max_batch` rows may need, largest first;
        the buckets held (none once a capture has failed)."""
        if self.failed:
            return ()
        for size in capture_plan(max_batch):
            if size not in self.ready and not self._prepare(size):
                return ()
        return self.ready

    def holds(self, batch: int) -> bool:
        """Whether a call of `batch` rows runs here (else the eager path runs it)."""
        return not self.failed and self._size(batch) is not None

    def _size(self, batch: int) -> int | None:
        return next((size for size in self.ready if size >= batch), None)

    def static(self, batch: int) -> Step:
        """The runner whose buffers a call of `batch` rows is loaded into."""
        return self._static[self._size(batch)]

    def run(self, batch: int) -> str:
        """Run the bucket that holds `batch` rows on what its buffers hold: "replays" when a
        graph replayed, "static" when the buffers ran without one."""
        size = self._size(batch)
        graph = self._graphs.get(size)
        if graph is not None:
            graph.replay()
            return "replays"
        self._static[size].run()
        return "static"

    def _prepare(self, size: int) -> bool:
        started = time.perf_counter()
        try:
            static = self._make(size)
            if self.capture:
                self._graphs[size] = _capture(static, self.pool.handle)
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - any failed capture leaves the eager path
            log.warning("%s CUDA graph capture failed (batch %d), eager from now: %s",
                        self.name, size, exc)
            self._graphs.clear()
            self._static.clear()
            self.failed = True
            return False
        self._static[size] = static
        if self.capture:
            self.capture_ms[size] = round((time.perf_counter() - started) * 1000, 1)
        return True


def _capture(static: Step, pool) -> torch.cuda.CUDAGraph:
    # Warm-up on a side stream, as torch.cuda.graphs asks: lazy inits, cuBLAS workspaces and
    # compiled kernels' autotuning happen outside the capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            static.run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: work other threads of the process put on the GPU meanwhile does not
    # invalidate this capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        static.run()
    return graph
