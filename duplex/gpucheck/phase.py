"""One phase of the check in a process of its own, so the runner can stop it at its time limit
(a stage call on a GPU cannot be interrupted from another thread) and a crash ends only it:

    python -m duplex.gpucheck.phase NAME --out gpu-check-out

It runs the profile the runner saved in the output folder (profile.json).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from duplex.gpucheck.profile import PHASES, Profile
from duplex.gpucheck.record import PhaseRecord


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duplex.gpucheck.phase")
    parser.add_argument("name", choices=PHASES)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    record = PhaseRecord(args.out, args.name)
    module = importlib.import_module(f"duplex.gpucheck.{args.name}")
    module.run(Profile.load(Path(args.out)), record)
    return 1 if record.failed else 0


if __name__ == "__main__":
    sys.exit(main())
