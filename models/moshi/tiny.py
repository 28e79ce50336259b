"""Tiny random-weight Moshi checkpoints, and loading any Moshi checkpoint from a local directory.

The tiny Mimi keeps the real codec geometry (24 kHz, upsampling 8x6x5x4 then x2: 1920-sample
frames at 12.5 Hz) with few channels and layers, so timing and framing match the real model.
Transformers initialises Mimi's codebooks to zeros (every code decodes to the same vector and
every frame encodes to code 0); the tiny builders fill them with noise so codes mean something.
No tokenizer is downloaded: `build_tiny` writes one text piece per token id to
`text_pieces.json`, which `text_detokenizer` reads back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import MimiConfig, MimiModel, MoshiConfig, MoshiForConditionalGeneration

TEXT_PIECES = "text_pieces.json"

_TEXT_SPECIALS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def tiny_mimi_config(**overrides) -> MimiConfig:
    params = {
        "hidden_size": 32,
        "num_filters": 8,
        "upsampling_ratios": [8, 6, 5, 4],
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "codebook_size": 64,
        "codebook_dim": 16,
        "vector_quantization_hidden_dimension": 16,
        "num_quantizers": 8,
        "upsample_groups": 32,
    }
    params.update(overrides)
    return MimiConfig(**params)


def tiny_moshi_config(**overrides) -> MoshiConfig:
    params = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "ffn_dim": 64,
        "num_codebooks": 4,
        "audio_encoder_config": tiny_mimi_config().to_dict(),
        "depth_decoder_config": {
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "ffn_dim": 32,
            "max_position_embeddings": 5,
        },
        **_TEXT_SPECIALS,
    }
    params.update(overrides)
    return MoshiConfig(**params)


@torch.no_grad()
def randomize_codebooks(mimi: MimiModel, generator: torch.Generator) -> None:
    for module in mimi.modules():
        if hasattr(module, "embed_sum") and hasattr(module, "cluster_usage"):
            module.embed_sum.copy_(torch.randn(module.embed_sum.shape, generator=generator))
            module.cluster_usage.fill_(1.0)
            module._embed = None


def tiny_mimi(seed: int = 0, **overrides) -> MimiModel:
    """A tiny random Mimi codec with meaningful codebooks, in eval mode."""
    torch.manual_seed(seed)
    mimi = MimiModel(tiny_mimi_config(**overrides)).eval()
    randomize_codebooks(mimi, torch.Generator().manual_seed(seed))
    return mimi


def _text_pieces(vocab_size: int) -> list[str]:
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    specials = set(_TEXT_SPECIALS.values()) | {0}
    return [
        ""
        if i in specials
        else (" " if i % 3 == 0 else "") + consonants[i % 14] + vowels[i // 14 % 5]
        for i in range(vocab_size)
    ]


def build_tiny(path: str | Path, seed: int = 0) -> MoshiForConditionalGeneration:
    """Save a tiny random Moshi (and its text pieces) to `path`; returns the saved model."""
    path = Path(path)
    torch.manual_seed(seed)
    config = tiny_moshi_config()
    model = MoshiForConditionalGeneration(config).eval()
    randomize_codebooks(model.audio_encoder, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    (path / TEXT_PIECES).write_text(json.dumps(_text_pieces(config.vocab_size)))
    return model


def load(
    path: str | Path, device: str = "cpu", dtype: str | torch.dtype = "float32"
) -> MoshiForConditionalGeneration:
    """Load a Moshi checkpoint from a local directory; never touches the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = MoshiForConditionalGeneration.from_pretrained(
        str(path), dtype=dtype, local_files_only=True
    )
    return model.to(device).eval()


def text_detokenizer(path: str | Path, config: MoshiConfig) -> Callable[[int], str]:
    """Token id -> text piece, from `text_pieces.json` or else the checkpoint's own tokenizer.

    Special ids (pad, which Moshi's text stream emits most of the time, BOS, EOS) map to "".
    """
    pieces_file = Path(path) / TEXT_PIECES
    if pieces_file.exists():
        pieces = json.loads(pieces_file.read_text())
        return lambda token: pieces[token] if 0 <= token < len(pieces) else ""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    specials = {config.pad_token_id, config.bos_token_id, *eos}

    def detokenize(token: int) -> str:
        if token in specials or not 0 <= token < config.vocab_size:
            return ""
        return tokenizer.convert_ids_to_tokens(token).replace("\u2581", " ")

    return detokenize


def tiny_long_call_moshi(seed: int = 0) -> MoshiForConditionalGeneration:
    """The smallest Moshi of the real layout, for driving long calls step by step in tests:
    one layer each, two codebooks, a Mimi at 200 Hz (16-sample frames at 12.5 Hz) and short
    attention windows, so the windows fill within a few dozen steps."""
    mimi = tiny_mimi_config(
        sampling_rate=200, upsampling_ratios=[8], num_hidden_layers=1, sliding_window=8,
        num_residual_layers=1, hidden_size=16, num_filters=4, upsample_groups=16,
        codebook_dim=8, vector_quantization_hidden_dimension=8, num_quantizers=2,
        intermediate_size=32,
    )
    config = tiny_moshi_config(
        num_hidden_layers=1, sliding_window=16, num_codebooks=2,
        audio_encoder_config=mimi.to_dict(),
        depth_decoder_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "ffn_dim": 32, "max_position_embeddings": 3},
    )
    torch.manual_seed(seed)
    model = MoshiForConditionalGeneration(config).eval()
    randomize_codebooks(model.audio_encoder, torch.Generator().manual_seed(seed))
    return model
