"""Per-stage timing and batch-size records, kept as plain numbers for the bench and metrics."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50 and p95 of `values`, and how many there were: a p95 of 16 values is nearly the worst."""
    if not values:
        return {"p50": None, "p95": None, "n": 0}
    arr = np.asarray(values, dtype=np.float64)
    return {"p50": round(float(np.percentile(arr, 50)), 3),
            "p95": round(float(np.percentile(arr, 95)), 3), "n": len(values)}


@dataclass
class StageStats:
    compute_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {
            "compute_ms": percentiles(self.compute_ms),
            "queue_ms": percentiles(self.queue_ms),
            "mean_batch": round(float(np.mean(self.batch_sizes)), 3) if self.batch_sizes else None,
            "calls": len(self.batch_sizes),
            "items": int(sum(self.batch_sizes)),
            "total_ms": round(float(sum(self.compute_ms)), 3),
        }


class EngineStats:
    def __init__(self) -> None:
        self.stages: dict[str, StageStats] = defaultdict(StageStats)
        self.busy_s = 0.0
        self.busy_cpu_s = 0.0
        self.steps = 0

    def summary(self) -> dict[str, object]:
        return {name: st.summary() for name, st in sorted(self.stages.items())}

    def take(self) -> dict[str, tuple[list[float], list[float], list[int]]]:
        """Remove and return the samples recorded so far, per stage (queue, compute, batch).
        The recording thread (the engine's, or the reader of an engine process's reports)
        appends while this runs; taking a prefix and deleting exactly it
        loses nothing."""
        taken = {}
        for name, st in list(self.stages.items()):
            parts = []
            for values in (st.queue_ms, st.compute_ms, st.batch_sizes):
                n = len(values)
                parts.append(values[:n])
                del values[:n]
            taken[name] = tuple(parts)
        return taken

    def add(self, taken: dict[str, tuple[list[float], list[float], list[int]]]) -> None:
        """Append samples another EngineStats gave up with `take`."""
        for name, (queue_ms, compute_ms, batch_sizes) in taken.items():
            st = self.stages[name]
            st.queue_ms += queue_ms
            st.compute_ms += compute_ms
            st.batch_sizes += batch_sizes
