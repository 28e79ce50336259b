"""How long a stage call took, charged to the stage that did the work.

On the CPU a call's work is done when it returns: its wall time is its cost. On a CUDA device a
call returns once its kernels are queued, and the GPU runs them later, so a host clock would
charge a stage's GPU time to whichever later call waits for the device (the codec's read of
its PCM, the Thinker's of its tokens). There the cost is the device's own time between two
events recorded on the stream around the call, read back later: once per step without waiting
(`collect`), and waiting only when a report needs every figure (`collect(wait=True)`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any


class StageClock:
    def __init__(self, device: str, clock: Callable[[], float] = time.perf_counter,
                 event: Callable[[], Any] | None = None) -> None:
        """`clock` (seconds) times calls of a model that is not on a CUDA device; `event`
        makes the events of one that is (`torch.cuda.Event` with timing)."""
        self.clock = clock
        self.cuda = str(device).startswith("cuda")
        self._event = event
        self._pending: deque[tuple[Any, Any, list[float]]] = deque()

    @contextmanager
    def timed(self, sink: list[float]) -> Iterator[None]:
        """Time the block; its milliseconds go to `sink` (on a CUDA device, once collected)."""
        if not self.cuda:
            start = self.clock()
            yield
            sink.append((self.clock() - start) * 1000)
            return
        if self._event is None:
            import torch

            self._event = partial(torch.cuda.Event, enable_timing=True)
        start, end = self._event(), self._event()
        start.record()
        yield
        end.record()
        self._pending.append((start, end, sink))

    def collect(self, wait: bool = False) -> None:
        """Hand the finished calls' times to their sinks, in call order; with `wait`, every
        call's, waiting for the device to reach the last one."""
        while self._pending:
            start, end, sink = self._pending[0]
            if not wait and not end.query():
                return
            end.synchronize()
            sink.append(start.elapsed_time(end))
            self._pending.popleft()
