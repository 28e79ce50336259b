"""`make gpu-check`: the first run on a GPU host, in one command and at most 9 minutes.

    python3 -m duplex.gpucheck [--device cuda|cpu] [--wheels gpu-wheels] [--out gpu-check-out]

Run from the checkout's root with the host's own python3 and torch (no venv, no network).
First the wheels `make gpu-wheels` downloaded for this CPython are installed with `pip install
--no-index --no-deps --target`; then the phases run in order, each in a process of its own
under its own time limit (profile.py): one that overruns is stopped and recorded as such, and
the next still runs; the bench takes whatever time is left. Each phase writes its JSON into the
output folder as it goes, and `summary.md` / `summary.json` come last. Exit status 0 when every
phase finished without an error.

Standard library only, up to the install: this module runs before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from duplex.gpucheck import record, summary
from duplex.gpucheck.host import PYTHON, wheel_dir
from duplex.gpucheck.profile import PHASES, PROFILES, Profile
from duplex.gpucheck.wheels import read_record

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_S = 10.0
"""Kept back from the last phase for the summary."""
MIN_PHASE_S = 20.0
"""With less than this left of the run, a phase is skipped, not started to be stopped."""
STOP_GRACE_S = 5.0


class CheckError(Exception):
    pass


def install(wheels: Path, site: Path) -> dict:
    """This CPython's wheels into `site`, replacing what an earlier run put there."""
    python = "{}.{}".format(*sys.version_info[:2])
    folder = wheel_dir(wheels, python)
    found = read_record(folder)
    if found is None:
        raise CheckError(
            f"no wheels for CPython {python} in {folder}: run `make gpu-wheels GPU_PYTHON="
            f"{python}` on a machine with the package index and bring {wheels}/ here "
            f"(the default is for CPython {PYTHON})")
    shutil.rmtree(site, ignore_errors=True)
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
         "--disable-pip-version-check", "--target", str(site),
         *(str(folder / name) for name in found["wheels"])],
        check=True,
    )
    return {"wheels": len(found["wheels"]), "wheels MiB": round(found["bytes"] / 2**20, 1),
            "install s": round(time.monotonic() - started, 1), "target": str(site)}


def run_phase(name: str, profile: Profile, out: Path, limit: float, env: dict) -> dict:
    started = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        # A session of its own: stopping it stops what it started (the bench's engine).
        proc = subprocess.Popen(
            [sys.executable, "-m", "duplex.gpucheck.phase", name, "--out", str(out)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            code = proc.wait(timeout=limit)
            status = "ok" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(proc)
            status = "timeout"
    error = None
    if status == "failed":
        error = "".join((out / f"{name}.log").read_text().splitlines(keepends=True)[-20:])
    return record.finish(out, name, status, time.monotonic() - started, round(limit), error)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def check(profile: Profile, wheels: Path, out: Path, site: Path, phases: list[str],
          limits: dict[str, float], log=print) -> bool:
    started = time.monotonic()
    deadline = started + limits.get("total", profile.total_s)
    out.mkdir(parents=True, exist_ok=True)
    for old in (*out.glob("*.json"), *out.glob("*.log"), *out.glob("summary.*")):
        old.unlink()
    profile.save(out)
    rec = record.PhaseRecord(out, "install")
    try:
        rec.update(install(wheels, site))
        record.finish(out, "install", "ok", time.monotonic() - started, None)
    except (CheckError, subprocess.CalledProcessError) as exc:
        record.finish(out, "install", "failed", time.monotonic() - started, None, str(exc))
        log(f"gpu-check: {exc}")
        summary.write(out, ["install"], f"GPU check on {profile.device}: wheels not installed")
        return False
    # Offline: an air-gapped host would otherwise wait on the hub's timeouts.
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(site), str(ROOT),
                                                      os.environ.get("PYTHONPATH")) if p))
    for i, name in enumerate(phases):
        left = deadline - time.monotonic() - SUMMARY_S
        if left < MIN_PHASE_S:
            record.finish(out, name, "skipped", 0.0, round(max(left, 0)),
                          "no time left in the run")
            log(f"gpu-check: {name}: skipped, {max(left, 0):.0f} s left")
            continue
        limit = min(limits.get(name, profile.limits_s.get(name, left)), left)
        log(f"gpu-check: {name} (phase {i + 1} of {len(phases)}, limit {limit:.0f} s)")
        done = run_phase(name, profile, out, limit, env)
        log(f"gpu-check: {name}: {done['status']} in {done['seconds']:.0f} s")
    heading = (f"GPU check on {profile.device}: {profile.bench_model} in {profile.dtype}, "
               f"{time.monotonic() - started:.0f} s")
    log(summary.write(out, ["install", *phases], heading))
    statuses = [(record.read(out, name) or {}).get("status") for name in ["install", *phases]]
    return all(status == "ok" for status in statuses)


def _limits(values: list[str]) -> dict[str, float]:
    limits = {}
    for value in values:
        name, _, seconds = value.partition("=")
        if name not in (*PHASES, "total") or not seconds:
            raise argparse.ArgumentTypeError(f"--limit {value}: want PHASE=SECONDS, PHASE one "
                                             f"of {', '.join(PHASES)} or total")
        limits[name] = float(seconds)
    return limits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m duplex.gpucheck",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(PROFILES),
                        default=os.environ.get("GPU_CHECK_DEVICE", "cuda"),
                        help="cuda (default; Qwen3-Omni-30B-A3B's shape) or cpu (the tiny "
                        "model, a few minutes)")
    parser.add_argument("--wheels", default=os.environ.get("GPU_WHEELS", "gpu-wheels"),
                        help="what `make gpu-wheels` downloaded (default gpu-wheels)")
    parser.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "gpu-check-out"),
                        help="where the phases' JSON and the summary go (default "
                        "gpu-check-out)")
    parser.add_argument("--site", default=os.environ.get("GPU_CHECK_SITE", ".gpu-check-site"),
                        help="where the wheels are installed (default .gpu-check-site)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"which phases, in this order (default {','.join(PHASES)})")
    parser.add_argument("--limit", action="append", default=[], metavar="PHASE=SECONDS",
                        help="override a phase's time limit, or the whole run's (total=S)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a field of the device's profile (duplex/gpucheck/"
                        "profile.py), e.g. batches=1,8 or bench_max_sessions=32")
    args = parser.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {unknown}; have {', '.join(PHASES)}")
    try:
        limits = _limits(args.limit)
        profile = PROFILES[args.device].overridden(args.set)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    ok = check(profile, Path(args.wheels).resolve(), Path(args.out).resolve(),
               Path(args.site).resolve(), phases, limits)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
