"""`make gpu-wheels`: download, on a machine with the package index, what the GPU host's image
lacks (`wheels.txt`) as wheels for the host's CPython, and check they fit in 64 MiB.

    python -m duplex.gpucheck.wheels [--python-version 3.12] [--dest gpu-wheels]

The wheels land in DEST/pyX.Y/ with a `.complete` record of what was downloaded; a second run
with the same requirements finds it and downloads nothing. Standard library and pip only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from duplex.gpucheck.host import PLATFORMS, PYTHON, WHEELS_LIMIT, carried, wheel_dir

RECORD = ".complete"


class WheelsError(Exception):
    pass


def total_bytes(wheels: list[Path]) -> int:
    return sum(w.stat().st_size for w in wheels)


def check_size(wheels: list[Path], limit: int = WHEELS_LIMIT) -> int:
    """Their total size; WheelsError, naming the largest, when it passes `limit`."""
    total = total_bytes(wheels)
    if total > limit:
        largest = sorted(wheels, key=lambda w: w.stat().st_size, reverse=True)[:3]
        names = ", ".join(f"{w.name} ({w.stat().st_size / 2**20:.1f} MiB)" for w in largest)
        raise WheelsError(f"the wheels weigh {total / 2**20:.1f} MiB, over the "
                          f"{limit / 2**20:.0f} MiB a GPU host takes; largest: {names}")
    return total


def read_record(folder: Path) -> dict | None:
    """What the last complete download there holds, or None if there is none (or a wheel it
    lists has gone)."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not all((folder / name).is_file() for name in record.get("wheels", ())):
        return None
    return record


def download(python: str, dest: str | Path, log=print) -> dict:
    """The wheels for CPython `python` in DEST/pyX.Y, downloaded unless already there."""
    folder = wheel_dir(dest, python)
    requirements = carried()
    wanted = {"python": python, "platforms": list(PLATFORMS), "requirements": requirements}
    record = read_record(folder)
    if record is not None and {k: record.get(k) for k in wanted} == wanted:
        log(f"{folder}: {len(record['wheels'])} wheels, {record['bytes'] / 2**20:.1f} MiB, "
            "up to date")
        return record
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RECORD).unlink(missing_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--implementation", "cp", "--python-version", python, *platforms,
         "--dest", str(folder), *requirements],
        check=True,
    )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != len(requirements):
        raise WheelsError(f"{len(wheels)} wheels for {len(requirements)} requirements in {folder}")
    total = check_size(wheels)
    record = {**wanted, "wheels": [w.name for w in wheels], "bytes": total}
    (folder / RECORD).write_text(json.dumps(record, indent=2))
    log(f"{folder}: {len(wheels)} wheels, {total / 2**20:.1f} MiB of "
        f"{WHEELS_LIMIT / 2**20:.0f} MiB")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duplex.gpucheck.wheels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", default=PYTHON,
                        help=f"the GPU host's CPython, X.Y (default {PYTHON})")
    parser.add_argument("--dest", default="gpu-wheels", help="wheels folder (default gpu-wheels)")
    args = parser.parse_args(argv)
    try:
        download(args.python_version, args.dest)
    except (WheelsError, subprocess.CalledProcessError) as exc:
        print(f"gpu-wheels: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
