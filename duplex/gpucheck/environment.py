"""Phase 1: what the host runs. Versions, the GPU and its free memory, which name the installed
transformers gives the cache argument, and whether the bench imports with what was carried."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys

from duplex.gpucheck.host import IMAGE, TRANSPORT_ONLY, carried
from duplex.gpucheck.profile import Profile
from duplex.gpucheck.record import PhaseRecord

BENCH_MODULES = ("duplex.cli", "duplex.bench.run", "duplex.engine.vad", "silero_vad", "soxr")
"""What `duplex bench` imports on its way to the first session (the VAD loads at start)."""


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def run(profile: Profile, record: PhaseRecord) -> None:
    before = set(sys.modules)
    record.set("python", f"{platform.python_version()} ({sys.executable})")
    record.set("platform", platform.platform())
    import torch

    record.set("torch", torch.__version__)
    record.set("torch CUDA", torch.version.cuda or "none")
    for dist in IMAGE:
        if dist != "torch":
            record.set(dist, version(dist))
    for requirement in carried():
        dist = requirement.split("==")[0]
        record.set(f"{dist} (carried)", version(dist))
    for dist in TRANSPORT_ONLY:
        record.set(f"{dist} (transport only)", version(dist))
    if profile.device == "cuda":
        record.attempt("gpu", lambda: _gpu(record, torch))
    from models.qwen3_omni import compat

    record.set("cache keyword (thinker, talker, code predictor)", ", ".join(
        (compat.THINKER_CACHE, compat.TALKER_CACHE, compat.CODE_PREDICTOR_CACHE)))
    record.set("torch grouped_mm", hasattr(torch.nn.functional, "grouped_mm")
               or hasattr(torch, "_grouped_mm"))
    imported = [
        record.attempt(f"import {module}", lambda module=module: importlib.import_module(module))
        for module in BENCH_MODULES
    ]
    record.set("bench imports", "ok" if all(imported) else "failed")
    record.set("import closure (distributions)", ", ".join(_closure(before)))


def _closure(before: set[str]) -> list[str]:
    """The distributions whose modules this phase brought in: torch, transformers, what the
    adapter and the bench import."""
    owners = importlib.metadata.packages_distributions()
    tops = {name.partition(".")[0] for name in set(sys.modules) - before}
    return sorted({dist for top in tops for dist in owners.get(top, ())})


def _gpu(record: PhaseRecord, torch) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    record.set("gpu", f"{props.name} (sm_{props.major}{props.minor}), "
               f"{torch.cuda.device_count()} visible")
    record.set("gpu memory GiB (free / total)", f"{free / 2**30:.1f} / {total / 2**30:.1f}")
    record.set("cuDNN", torch.backends.cudnn.version())
