"""What the transformers releases duplex runs on (5.17 to 5.25) name differently.

CUDA images ship transformers 5.17, development runs the newest. Two differences reach the
adapter, each read once from the installed release, not per call:

- The forwards' KV cache keyword. 5.24 renamed `past_key_values` to `cache` (the old name
  deprecated until 5.40); 5.17 knows only `past_key_values`. Under a name a forward does not
  declare, the cache falls into its **kwargs: no KV is written or read, and the first prefill
  fails on the mask's shape (or attends to nothing where the shapes happen to agree).
- Where the Thinker keeps its parts. Up to 5.17 `thinker.model` is the text model and the
  audio and vision encoders sit beside it on `thinker`; later `thinker.model` holds all three
  (`language_model`, `audio_tower`, `visual`). The weights and the forwards are the same.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

CACHE_NAMES = ("cache", "past_key_values")
"""Newest first: a forward that declares both (a release in between) takes the new one."""


def cache_keyword(model_class: type) -> str:
    """The name `model_class.forward` declares for its cache; ImportError if neither."""
    # inspect follows functools.wraps through transformers' decorators to the real forward.
    parameters = inspect.signature(model_class.forward).parameters
    for name in CACHE_NAMES:
        if name in parameters:
            return name
    raise ImportError(f"{model_class.__name__}.forward takes its cache under none of "
                      f"{CACHE_NAMES}; this transformers is not one duplex knows")


THINKER_CACHE = cache_keyword(modeling.Qwen3OmniMoeThinkerTextModel)
TALKER_CACHE = cache_keyword(modeling.Qwen3OmniMoeTalkerModel)
CODE_PREDICTOR_CACHE = cache_keyword(modeling.Qwen3OmniMoeTalkerCodePredictorModel)


@dataclass(frozen=True)
class ThinkerParts:
    text: torch.nn.Module
    """The language model: embeddings, decoder layers, final norm (not the head)."""
    audio: torch.nn.Module
    vision: torch.nn.Module


def thinker_parts(model) -> ThinkerParts:
    """The Thinker's text model and encoders of a `Qwen3OmniMoeForConditionalGeneration`."""
    inner = model.thinker.model
    if hasattr(inner, "language_model"):
        return ThinkerParts(inner.language_model, inner.audio_tower, inner.visual)
    return ThinkerParts(inner, model.thinker.audio_tower, model.thinker.visual)
