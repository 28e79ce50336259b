"""The GPU host the check is made for, as ../shared/GPU.md describes it: one H200, x86-64,
CPython 3.12, a stock CUDA PyTorch image (torch 2.11 + CUDA 13, transformers 5.17) and no
package index. What the image lacks arrives as wheels (`wheels.txt`, `python -m
duplex.gpucheck.wheels`), at most 64 MiB together, installed with `pip install --no-index
--no-deps --target DIR`. Standard library only: this runs before anything is installed.
"""

from __future__ import annotations

from pathlib import Path

PYTHON = "3.12"
"""The host's CPython; `make gpu-wheels GPU_PYTHON=X.Y` downloads for another."""

PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
"""Wheel platforms the host takes: soxr publishes only manylinux_2_28 wheels, pydantic-core
only manylinux2014 ones (pip does not count either as the other); CUDA 13 images are Ubuntu
22.04 or later, glibc 2.35 and up."""

IMAGE = (
    "torch", "transformers", "numpy", "tokenizers", "safetensors", "onnxruntime",
    "prometheus-client", "uvloop", "httpx", "psutil", "xxhash", "pyyaml", "jinja2",
)
"""What the image holds, with what each of them requires (and pip, and the scientific stack,
which duplex does not use)."""

NOT_IN_IMAGE = (
    "av", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "starlette",
    "uvicorn", "websockets", "soxr", "silero-vad", "aiortc", "livekit", "redis",
)
"""What the image does not hold, even where something in IMAGE names it as optional."""

TRANSPORT_ONLY = ("av", "livekit", "aiortc", "redis", "websockets", "uvicorn")
"""Needed by the server's transports, not by the bench or the check: never carried (av and
livekit alone are 180 MB installed)."""

WHEELS_LIMIT = 64 * 2**20
"""What the carried wheels may weigh together."""

REQUIREMENTS = Path(__file__).with_name("wheels.txt")


def carried() -> list[str]:
    """The pinned requirements of `wheels.txt`: exactly what the image lacks for the check."""
    lines = (line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line]


def wheel_dir(root: str | Path, python: str) -> Path:
    """Where the wheels for CPython `python` ("3.12") lie under the wheels folder."""
    return Path(root) / f"py{python}"
