"""Resolve `--model NAME|PATH` to a loaded adapter. Nothing is ever downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from models.base import DuplexModel
from models.caches import CacheBudgets

TINY = {"tiny-omni": "qwen3_omni_moe", "tiny-moshi": "moshi"}
SHAPED = "shaped:qwen3-omni-30b-a3b"
"""Built in memory on the serving device at load, at full depth or `SHAPED:LAYERS`: a checkpoint
of the full model (70 GB) need not fit on the disk. `duplex models build` writes one instead."""


class ModelNotFound(Exception):
    pass


def select_device(preference: str = "auto", dtype: str = "auto") -> tuple[str, str]:
    """(device, dtype): cuda with bf16 when present, cpu with fp32 otherwise; a `dtype` other
    than auto is kept."""
    import torch

    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ModelNotFound("device 'cuda' was asked for but no CUDA device is present")
        return "cuda", "bfloat16" if dtype == "auto" else dtype
    return "cpu", "float32" if dtype == "auto" else dtype


def shaped_layers(name: str) -> int | None:
    """The layer cap a shaped model's name asks for (None: full depth); raises ModelNotFound
    for a name that is not a shaped model's."""
    head, _, layers = name.partition(f"{SHAPED}:")
    if name == SHAPED:
        return None
    if head or not layers.isdigit() or int(layers) < 1:
        raise ModelNotFound(f"'{name}' is not {SHAPED} or {SHAPED}:LAYERS (LAYERS >= 1)")
    return int(layers)


def is_shaped(name: str) -> bool:
    return name == SHAPED or name.startswith(f"{SHAPED}:")


def tiny_path(name: str, cache_dir: str | Path) -> Path:
    return Path(cache_dir) / name


def build_tiny(name: str, cache_dir: str | Path, progress=None) -> Path:
    """Build a tiny random-weight checkpoint; `progress(message)` hears each step."""
    path = tiny_path(name, cache_dir)
    report = progress or (lambda message: None)
    if TINY.get(name) == "qwen3_omni_moe":
        from models.qwen3_omni.tiny import build_tiny as build_omni

        build_omni(path, progress=report)
    elif TINY.get(name) == "moshi":
        from models.moshi.tiny import build_tiny as build_moshi

        report("building and saving tiny Moshi")
        build_moshi(path)
    else:
        raise ModelNotFound(f"unknown tiny model '{name}'; choose one of {sorted(TINY)}")
    report(f"saved {path}")
    return path


def checkpoint_config(name: str, cache_dir: str | Path = ".models") -> Path:
    """The config.json of a named tiny checkpoint or a checkpoint directory; raises
    ModelNotFound, with what to do about it, when there is none. `echo` needs none."""
    path = tiny_path(name, cache_dir) if name in TINY else Path(name)
    config = path / "config.json"
    if not config.is_file():
        hint = f"; build it with `duplex models build {name}`" if name in TINY else ""
        raise ModelNotFound(f"no model checkpoint at {path} (config.json missing){hint}")
    return config


def load_model(
    name: str,
    cache_dir: str | Path = ".models",
    device: str = "auto",
    dtype: str = "auto",
    cuda_graphs: bool = False,
    budgets: CacheBudgets | None = None,
    kv_memory: float = 0.0,
) -> DuplexModel:
    """`cuda_graphs` lets a Qwen3-Omni adapter on a CUDA device replay its fixed-shape decode
    steps as CUDA graphs; elsewhere it changes nothing. `budgets`: the cross-session caches'.
    `kv_memory`: a Qwen3-Omni adapter's KV pools' budget (`engine.kv_memory`)."""
    if name == "echo":
        from models.echo import EchoModel

        return EchoModel()
    dev, dtype = select_device(device, dtype)
    if is_shaped(name):
        from models.qwen3_omni.shaped import load_shaped

        return load_shaped(shaped_layers(name), dev, dtype, cuda_graphs, kv_memory)
    config = checkpoint_config(name, cache_dir)
    path = config.parent
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type == "qwen3_omni_moe":
        from models.qwen3_omni.adapter import Qwen3OmniAdapter

        return Qwen3OmniAdapter.from_pretrained(
            path, device=dev, dtype=dtype, cuda_graphs=cuda_graphs, budgets=budgets,
            kv_memory=kv_memory,
        )
    if model_type == "moshi":
        from models.moshi.adapter import MoshiAdapter

        return MoshiAdapter.from_pretrained(path, device=dev, dtype=dtype)
    raise ModelNotFound(f"{path}: model_type '{model_type}' is not supported")
