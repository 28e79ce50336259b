"""How the check times a stage call, counts what makes the host wait for the device, and reads
memory: on a GPU with CUDA events, the sync debug mode and the caching allocator's counters; on
the CPU the same calls with wall time, the dispatch counter and the process's resident memory.
"""

from __future__ import annotations

import resource
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


@dataclass
class Timings:
    wall_ms: list[float] = field(default_factory=list)
    """From the call to the device finishing its work (the call's whole cost)."""
    gpu_ms: list[float] = field(default_factory=list)
    """CUDA events recorded before and after the call on its stream: the stream's time from
    the call's first launch to its last kernel's end, idle gaps (host syncs, Python) included."""

    def medians(self) -> dict[str, float | None]:
        return {
            "wall ms": round(statistics.median(self.wall_ms), 3) if self.wall_ms else None,
            "gpu ms": round(statistics.median(self.gpu_ms), 3) if self.gpu_ms else None,
        }


class Clock:
    def __init__(self, device: str) -> None:
        self.cuda = is_cuda(device)

    def time(self, call: Callable[[], Any], into: Timings) -> Any:
        """`call()`, its times appended to `into`."""
        if not self.cuda:
            start = time.perf_counter()
            result = call()
            into.wall_ms.append((time.perf_counter() - start) * 1000)
            return result
        # Nothing earlier may still run on the stream when the clock starts.
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        begin.record()
        result = call()
        end.record()
        end.synchronize()
        into.wall_ms.append((time.perf_counter() - start) * 1000)
        into.gpu_ms.append(begin.elapsed_time(end))
        return result


_SCALAR = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}
"""`.item()`, `bool(t)`, `int(t)`: a device value read on the host (under inference mode
the dispatcher shows `item` and `is_nonzero` themselves, not what they run)."""
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default}
"""Output shapes only the device knows: the host waits for them."""
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}
"""Indexing with a bool mask runs nonzero first."""


class SyncCounter(TorchDispatchMode):
    """Operations that make the host wait for a GPU, counted on any device: device values read
    on the host, data-dependent shapes, bool-mask indexing, tensors made from Python lists or
    arrays (on a GPU, a blocking copy from pageable memory) and copies between the host and a
    device. On the CPU it misses what no operation marks (`.tolist()` and `.numpy()` of a CPU
    tensor): a floor on what a GPU would wait for, where `torch.cuda.set_sync_debug_mode`
    counts them all."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SCALAR or func in _DATA_DEPENDENT:
            self.count += 1
        elif func in _BOOL_INDEXED:
            indices = args[1] if len(args) > 1 else ()
            self.count += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                              for i in indices)
        elif func is aten.lift_fresh.default:
            # torch.tensor(list) and from_numpy; a 0-dim one is a Python scalar wrapped for an
            # operation, which a GPU fills in place.
            self.count += out.dim() > 0
        elif func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = out if func is aten._to_copy.default else args[0]
            self.count += src.device.type != dst.device.type
        return out


@dataclass
class Syncs:
    counted: int = 0
    """By `SyncCounter`, on any device."""
    warned: int | None = None
    """By `torch.cuda.set_sync_debug_mode("warn")`: every synchronizing CUDA call (GPU only)."""


@contextmanager
def counting_syncs(device: str) -> Iterator[Syncs]:
    syncs = Syncs()
    counter = SyncCounter()
    if not is_cuda(device):
        with counter:
            yield syncs
        syncs.counted = counter.count
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with counter:
                yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs.counted = counter.count
    syncs.warned = sum("synchroniz" in str(w.message) for w in caught)


def reset_peak(device: str) -> None:
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats()


def memory(device: str) -> dict[str, float]:
    """GiB: allocated now and at peak since the last `reset_peak` (GPU), or the process's
    resident high-water mark (CPU)."""
    if is_cuda(device):
        free, total = torch.cuda.mem_get_info()
        return {
            "allocated GiB": round(torch.cuda.memory_allocated() / 2**30, 2),
            "peak allocated GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "free GiB": round(free / 2**30, 2),
        }
    return {"peak RSS GiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
