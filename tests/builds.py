"""What several tests use and is costly to make, made once per run: with pytest-xdist, once for
all the workers, whichever asks first."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)`'s path, built once per run however many xdist workers ask for it: the
    first builds it under a lock in the folder the run's workers share, the others wait for
    it and reuse it. Without xdist, in this session's own temporary folder."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent
    folder, done = shared / name, shared / f"{name}.built"
    with FileLock(shared / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed left
            folder.mkdir()
            done.write_text(str(build(folder)))
    return Path(done.read_text())
