"""Phase 4: `duplex bench --find-max` on the same model, in whatever time the others left.

The batched mode alone (one model build; a per-session search would build the 35 B model again
and take as long once more), bounded by the profile's session count and level duration, with
the code predictor as CUDA graphs on a GPU. Each load level the search finishes is recorded as
the bench reports it, so a search stopped at the time limit keeps the levels it finished; the
bench's own JSON (bench-report.json) comes at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from duplex.gpucheck.profile import Profile
from duplex.gpucheck.record import PhaseRecord

LEVEL = re.compile(r"^\s*(\w+) N=(\d+): realtime=(True|False) underruns=(\d+) lag_p95=(\S+)")
"""A finished load level as `duplex bench` logs it (duplex/bench/run.py, find_max)."""


def command(profile: Profile, report: str) -> list[str]:
    return [
        sys.executable, "-m", "duplex.cli", "bench",
        "--model", profile.bench_model, "--dtype", profile.dtype,
        "--find-max", "--batched-only",
        "--max-sessions", str(profile.bench_max_sessions),
        "--duration", str(profile.bench_duration_s),
        "--json", report,
    ]


def run(profile: Profile, record: PhaseRecord) -> None:
    report = record.out / "bench-report.json"
    report.unlink(missing_ok=True)
    env = dict(
        os.environ,
        DUPLEX_ENGINE__CUDA_GRAPHS="true" if profile.device == "cuda" else "false",
        # The tiny model is built here on first use, by the transformers this host runs.
        DUPLEX_MODEL__CACHE_DIR=str(record.out / "models"),
    )
    cmd = command(profile, str(report))
    record.set("command", " ".join(cmd[1:]))
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            if level := LEVEL.match(line):
                mode, n, realtime, underruns, lag = level.groups()
                record.set(f"{mode} N={n}", f"realtime={realtime} underruns={underruns} "
                                            f"input lag p95 {lag} ms")
    if proc.returncode:
        raise RuntimeError(f"duplex bench exited with {proc.returncode}")
    mode = json.loads(report.read_text())["modes"]["batched"]
    record.update({
        "max realtime sessions": mode["max_realtime_sessions"],
        "ceiling sessions": mode["ceiling_sessions"],
        "efficiency (max / ceiling)": mode["efficiency"],
        "engine ms per step": mode["engine_ms_per_step"],
        "engine ms per session frame": mode["engine_ms_per_session_frame"],
        "ttfa ms p50 / p95": _pair(mode["ttfa_ms"]),
        "pause ms p50 / p95": _pair(mode["pause_ms"]),
        "rss MB": mode["rss_mb"],
    })


def _pair(quantiles: dict) -> str:
    if quantiles.get("p50") is None:
        return "-"
    return f"{quantiles['p50']:.0f} / {quantiles['p95']:.0f}"
