"""A random-weight Qwen3-Omni at Qwen3-Omni-30B-A3B's real widths, with fewer layers if asked.

What a stage costs per frame depends on its widths (hidden sizes, heads, experts, vocabularies,
the codec's channels) and grows with its depth; the published checkpoint's weights do not change
it. So the same adapter serving this checkpoint measures the real model's arithmetic, and with
`layers` the deep stacks are cut to fit a small machine:

- `layers` caps the Thinker (48 layers), the audio encoder (32), the vision encoder (27) and the
  Talker (20). Where a stack refers to one of its own layers (the Talker's `accept_hidden_layer`,
  the vision encoder's deepstack layers) the index is scaled with it.
- The code predictor (5 layers) and Code2Wav (an 8-layer transformer and the conv decoder) keep
  their published depth: they are small, and their per-frame cost is what a duplex step is
  made of.

The tokenizer is the tiny byte-level one: the Thinker keeps its 152,064-row embedding and head
(so its logits cost what the real ones do), and rows past the tokenizer are never sampled.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from models.qwen3_omni.compat import thinker_parts
from models.qwen3_omni.tiny import (
    OPTIONS_FILE,
    RANDOM_WEIGHTS_OPTIONS,
    SEED,
    TOKEN_IDS,
    fix_random_init,
    preprocessor_config,
    tiny_tokenizer,
)

NAME = "shaped:qwen3-omni-30b-a3b"

PUBLISHED = {
    "thinker_config": {
        "audio_config": {
            "num_mel_bins": 128,
            "d_model": 1280,
            "encoder_layers": 32,
            "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120,
            "downsample_hidden_size": 480,
            "output_dim": 2048,
            "n_window": 50,
            "n_window_infer": 800,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 27,
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "out_hidden_size": 2048,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [8, 16, 24],
            "hidden_act": "gelu_pytorch_tanh",
        },
        "text_config": {
            "vocab_size": 152064,
            "hidden_size": 2048,
            "intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 65536,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [24, 20, 20],
                "interleaved": True,
            },
        },
    },
    "talker_config": {
        "text_config": {
            "vocab_size": 3072,
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "num_hidden_layers": 20,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "moe_intermediate_size": 384,
            "shared_expert_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 6,
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 65536,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "mrope_section": [24, 20, 20],
                "interleaved": True,
            },
        },
        "code_predictor_config": {
            "vocab_size": 2048,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 5,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_code_groups": 16,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        "num_code_groups": 16,
        "thinker_hidden_size": 2048,
        "accept_hidden_layer": 24,
        "codec_pad_id": 2148,
        "codec_bos_id": 2149,
        "codec_eos_token_id": 2150,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "spatial_merge_size": 2,
        "position_id_per_seconds": 13,
        "seconds_per_chunk": 2,
    },
    "code2wav_config": {
        "codebook_size": 2048,
        "num_quantizers": 16,
        "num_semantic_quantizers": 1,
        "semantic_codebook_size": 4096,
        "codebook_dim": 512,
        "vector_quantization_hidden_dimension": 512,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "sliding_window": 72,
        "decoder_dim": 1536,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "layer_scale_initial_scale": 0.01,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
"""Widths and depths of Qwen/Qwen3-Omni-30B-A3B-Instruct's config.json (the fields that shape
the arithmetic), as published with the checkpoint. Token ids are not here: they follow the tiny
tokenizer (`shaped_config`)."""

DEPTHS = {
    "thinker": ("thinker_config", "text_config", "num_hidden_layers"),
    "audio encoder": ("thinker_config", "audio_config", "encoder_layers"),
    "vision encoder": ("thinker_config", "vision_config", "depth"),
    "talker": ("talker_config", "text_config", "num_hidden_layers"),
}
"""The stacks `layers` caps, by where their depth lives in the config."""


def _get(tree: dict, path: tuple[str, ...]) -> int:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: int) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _scaled_index(index: int, depth: int, layers: int) -> int:
    """Layer `index` of a `depth`-layer stack, at the same relative height in `layers` layers."""
    return min(layers - 1, index * layers // depth)


def shaped_dict(layers: int | None = None) -> dict:
    """The published widths with every stack in DEPTHS cut to `layers` (None: full depth)."""
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    tree = copy.deepcopy(PUBLISHED)
    if layers is None:
        return tree
    depth = {name: _get(PUBLISHED, path) for name, path in DEPTHS.items()}
    for name, path in DEPTHS.items():
        _set(tree, path, min(layers, depth[name]))
    vision = tree["thinker_config"]["vision_config"]
    vision["deepstack_visual_indexes"] = sorted(
        {_scaled_index(i, depth["vision encoder"], vision["depth"])
         for i in PUBLISHED["thinker_config"]["vision_config"]["deepstack_visual_indexes"]}
    )
    talker = tree["talker_config"]
    thinker_layers = tree["thinker_config"]["text_config"]["num_hidden_layers"]
    # hidden_states[0] is the embedding output, [i] layer i's: the published 24 of 48 is
    # the middle of the stack, and it stays a layer's output, never the embeddings.
    talker["accept_hidden_layer"] = max(
        1, PUBLISHED["talker_config"]["accept_hidden_layer"] * thinker_layers // depth["thinker"]
    )
    return tree


def shaped_config(layers: int | None = None) -> Qwen3OmniMoeConfig:
    """The shaped model's config, special token ids those of the tiny tokenizer."""
    tree = shaped_dict(layers)
    mm_ids = {
        "audio_token_id": TOKEN_IDS["<|audio_pad|>"],
        "image_token_id": TOKEN_IDS["<|image_pad|>"],
        "video_token_id": TOKEN_IDS["<|video_pad|>"],
        "audio_start_token_id": TOKEN_IDS["<|audio_start|>"],
        "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
    }
    tree["thinker_config"].update(mm_ids, user_token_id=TOKEN_IDS["user"])
    tree["talker_config"].update(mm_ids)
    return Qwen3OmniMoeConfig(
        thinker_config=tree["thinker_config"],
        talker_config=tree["talker_config"],
        code2wav_config=tree["code2wav_config"],
        im_start_token_id=TOKEN_IDS["<|im_start|>"],
        im_end_token_id=TOKEN_IDS["<|im_end|>"],
        tts_pad_token_id=TOKEN_IDS["<|tts_pad|>"],
        tts_bos_token_id=TOKEN_IDS["<|tts_bos|>"],
        tts_eos_token_id=TOKEN_IDS["<|tts_eos|>"],
        system_token_id=TOKEN_IDS["system"],
        user_token_id=TOKEN_IDS["user"],
        assistant_token_id=TOKEN_IDS["assistant"],
    )


@dataclass(frozen=True)
class PartSize:
    name: str
    parameters: int
    bytes: int


def part_sizes(model: torch.nn.Module) -> list[PartSize]:
    """Parameters and bytes of each stage's module, and of the whole model last."""
    thinker = thinker_parts(model)
    parts = {
        "thinker": thinker.text,
        "thinker head": model.thinker.lm_head,
        "audio encoder": thinker.audio,
        "vision encoder": thinker.vision,
        "talker": model.talker.model,
        "code predictor": model.talker.code_predictor,
        "code2wav": model.code2wav,
        "total": model,
    }
    sizes = []
    for name, module in parts.items():
        params = list(module.parameters())
        sizes.append(PartSize(name, sum(p.numel() for p in params),
                              sum(p.numel() * p.element_size() for p in params)))
    return sizes


def shaped_model(
    layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> Qwen3OmniMoeForConditionalGeneration:
    """Seeded random weights, built directly in `dtype` on `device` (no float32 copy, and on a
    GPU no pass through host memory). Builds on different devices draw different weights."""
    config = shaped_config(layers)
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(previous)
    fix_random_init(model)
    return model


def load_shaped(layers: int | None, device: str, dtype: str, cuda_graphs: bool = False,
                kv_memory: float = 0.0):
    """The shaped model built in memory on `device` behind the Qwen3-Omni adapter, as a saved
    shaped checkpoint would load."""
    from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions

    model = shaped_model(layers, getattr(torch, dtype), device)
    return Qwen3OmniAdapter(
        model,
        tiny_tokenizer(),
        preprocessor_config(model.config),
        device,
        dtype,
        Qwen3OmniOptions(**RANDOM_WEIGHTS_OPTIONS),
        cuda_graphs=cuda_graphs,
        kv_memory=kv_memory,
    )


def default_path(cache_dir: str | os.PathLike, layers: int | None) -> Path:
    tail = "" if layers is None else f"-{layers}l"
    return Path(cache_dir) / f"shaped-qwen3-omni-30b-a3b{tail}"


def build_shaped(
    path: str | os.PathLike,
    layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[str], None] | None = None,
) -> list[PartSize]:
    """Write the shaped checkpoint directory; `load` (or any from_pretrained) reads it back."""
    say = progress or (lambda _msg: None)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    depth = "full depth" if layers is None else f"at most {layers} layers a stack"
    say(f"building {NAME} ({depth}, {str(dtype).removeprefix('torch.')})")
    model = shaped_model(layers, dtype)
    sizes = part_sizes(model)
    total = sizes[-1]
    say(f"saving {total.parameters:,} parameters ({total.bytes / 2**30:.2f} GiB) to {out}")
    model.save_pretrained(out)
    del model
    tiny_tokenizer().save_pretrained(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(shaped_config(layers)), indent=2)
    )
    (out / OPTIONS_FILE).write_text(json.dumps(RANDOM_WEIGHTS_OPTIONS, indent=2))
    say("shaped checkpoint ready")
    return sizes
