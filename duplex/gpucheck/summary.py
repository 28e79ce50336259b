"""`summary.md` and `summary.json` from the phases' JSON: one table of every figure, each
phase's status first. Standard library only."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from duplex.gpucheck.record import read


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return "-" if value is None else str(value)


def _status(data: dict) -> str:
    text = data.get("status", "missing")
    if data.get("seconds") is not None:
        text += f" in {data['seconds']:.0f} s"
    if data.get("limit_s") is not None:
        text += f" (limit {data['limit_s']:.0f} s)"
    return text


def rows(out: str | Path, phases: list[str]) -> list[tuple[str, str, Any]]:
    table = []
    for name in phases:
        data = read(out, name) or {"status": "missing"}
        table.append((name, "status", _status(data)))
        table.extend((name, figure, value) for figure, value in data.get("figures", {}).items())
        table.extend((name, f"error: {figure}", error)
                     for figure, error in data.get("errors", {}).items())
        if data.get("error"):
            # The last line of the log: the exception that ended it.
            table.append((name, "error", data["error"].strip().splitlines()[-1]))
    return table


def write(out: str | Path, phases: list[str], heading: str) -> str:
    """Write both files; returns the markdown."""
    out = Path(out)
    table = rows(out, phases)
    statuses = {name: (read(out, name) or {}).get("status", "missing") for name in phases}
    (out / "summary.json").write_text(json.dumps(
        {"heading": heading, "statuses": statuses,
         "figures": [{"phase": p, "figure": f, "value": v} for p, f, v in table]},
        indent=2, default=str))
    lines = [f"# {heading}", "", "| phase | figure | value |", "|---|---|---|"]
    lines += [f"| {p} | {f} | {_cell(v).replace('|', '/').replace(chr(10), ' ')} |"
              for p, f, v in table]
    markdown = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(markdown)
    return markdown
