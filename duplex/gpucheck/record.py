"""A phase's JSON in the output folder, rewritten whole after every figure, so a phase stopped
at its time limit leaves what it had finished. Standard library only.

    {"phase": "stages", "status": "running" | "ok" | "failed" | "timeout" | "skipped",
     "seconds": 12.3, "limit_s": 200, "figures": {"B=8 thinker_decode wall ms": 4.2, ...},
     "errors": {"figure": "RuntimeError: ..."}, "error": "the log's tail, when it failed"}
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATUSES = ("running", "ok", "failed", "timeout", "skipped")


def phase_path(out: str | Path, name: str) -> Path:
    return Path(out) / f"{name}.json"


def read(out: str | Path, name: str) -> dict | None:
    try:
        return json.loads(phase_path(out, name).read_text())
    except (OSError, ValueError):
        return None


def write(out: str | Path, name: str, data: dict) -> None:
    """Replace the phase's JSON in one rename: a reader never sees half a file."""
    path = phase_path(out, name)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


class PhaseRecord:
    def __init__(self, out: str | Path, name: str) -> None:
        self.out, self.name = Path(out), name
        self.data: dict[str, Any] = {"phase": name, "status": "running", "figures": {},
                                     "errors": {}}
        write(self.out, name, self.data)

    @property
    def figures(self) -> dict[str, Any]:
        return self.data["figures"]

    def set(self, figure: str, value: Any) -> None:
        self.update({figure: value})

    def update(self, figures: dict[str, Any]) -> None:
        self.figures.update(figures)
        write(self.out, self.name, self.data)

    def attempt(self, figure: str, measure: Callable[[], Any]) -> Any:
        """`measure()`, or None with its error kept under `figure`: one part of a phase that
        fails on a first GPU run leaves the other parts to run and be recorded."""
        try:
            return measure()
        except Exception as exc:  # noqa: BLE001 - recorded, and the phase ends failed
            traceback.print_exc()
            self.data["errors"][figure] = f"{type(exc).__name__}: {exc}"
            write(self.out, self.name, self.data)
            return None

    @property
    def failed(self) -> bool:
        return bool(self.data["errors"])


def finish(out: str | Path, name: str, status: str, seconds: float, limit_s: float | None,
           error: str | None = None) -> dict:
    """What the runner adds once a phase's process has ended (or was stopped): its status and
    time, over whatever the phase itself wrote."""
    data = read(out, name) or {"phase": name, "figures": {}, "errors": {}}
    data.update(status=status, seconds=round(seconds, 1), limit_s=limit_s)
    if error:
        data["error"] = error
    write(out, name, data)
    return data
