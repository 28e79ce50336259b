"""The models the check builds in memory: Qwen3-Omni-30B-A3B's widths (models/qwen3_omni/
shaped.py) on a GPU, the tiny model on the CPU, each behind the adapter the engine serves."""

from __future__ import annotations

import copy

import torch

from duplex.gpucheck.profile import Profile
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.shaped import shaped_model
from models.qwen3_omni.tiny import preprocessor_config, tiny_model, tiny_tokenizer


def model(profile: Profile, dtype: torch.dtype, layers: int | None):
    """Seeded random weights on the profile's device: the shaped model capped at `layers`
    (None: full depth), or the tiny one."""
    if profile.shaped:
        return shaped_model(layers, dtype, profile.device)
    return twin(tiny_model().to(profile.device), dtype)


def twin(source, dtype: torch.dtype):
    """A copy of `source` with its parameters in `dtype` (buffers kept: the rotary inv_freq
    stays fp32, as the adapter keeps it): identical weights, rounded."""
    copied = copy.deepcopy(source)
    with torch.no_grad():
        for param in copied.parameters():
            param.data = param.data.to(dtype)
    return copied


def adapter(built, profile: Profile, options: Qwen3OmniOptions,
            graphs: bool = False) -> Qwen3OmniAdapter:
    """`graphs`: the decode steps' and code predictor's CUDA graphs on a GPU, captured at
    `warm_up`; on the CPU the fixed buffers they would hold, without a graph."""
    dtype = str(next(built.parameters()).dtype).removeprefix("torch.")
    return Qwen3OmniAdapter(built, tiny_tokenizer(), preprocessor_config(built.config),
                            profile.device, dtype, options, cuda_graphs=graphs,
                            static_steps=graphs)
