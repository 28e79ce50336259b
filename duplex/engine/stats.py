"""Per-stage timing and batch-size records, kept as plain numbers for the bench and metrics."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None}
    arr = np.asarray(values, dtype=np.float64)
    return {"p50": round(float(np.percentile(arr, 50)), 3), "p95": round(float(np.percentile(arr, 95)), 3)}


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
        }


class EngineStats:
    def __init__(self) -> None:
        self.stages: dict[str, StageStats] = defaultdict(StageStats)
        self.busy_s = 0.0

    def summary(self) -> dict[str, object]:
        return {name: st.summary() for name, st in sorted(self.stages.items())}
