"""A tiny random-weight Qwen3-Omni of the real architecture, and the loader for any checkpoint.

The tiny model exists for tests and the embedded default: every part (audio tower, vision tower,
MoE Thinker, MoE Talker with code predictor, Code2Wav) is the real transformers class, only small.
`load` is the same path a full Qwen3-Omni checkpoint directory goes through.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
)

from models.qwen3_omni.codec import tiny_code2wav_config

BYTE_TOKENS = 256
"""The tiny tokenizer is byte-level BPE without merges: ids 0..255 are the 256 byte symbols."""

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)
ROLE_TOKENS = ("system", "user", "assistant")
"""Single tokens as in Qwen's vocabulary: generate() finds a turn's role by the id after
<|im_start|>."""

TOKEN_IDS = {tok: BYTE_TOKENS + i for i, tok in enumerate(SPECIAL_TOKENS + ROLE_TOKENS)}
THINKER_VOCAB = 288
"""Above the 272 tokens, padded like Qwen pads its embedding matrix past the tokenizer."""

CODEC_SPECIAL = {"pad": 0, "bos": 1, "eos": 2, "nothink": 3, "think_bos": 4, "think_eos": 5}
"""Offsets above the codebook, as in the real Talker where special codec ids follow the codes."""
SPEAKERS = ("ethan", "chelsie", "aiden")
TALKER_SUPPRESSED = 1024
"""`generate` suppresses the top 1024 Talker ids, so the vocabulary must leave codes below them."""

SPEAKER_STD = 2.0
"""At the init's std (0.02) a speaker row is about as long as the tts_pad it is added to, and
random attention spreads its one position thin: voices moved the Talker's logits by ~1e-3 and
flipped no code. Rows this long make each speaker's position its own direction, and greedy
replies in two voices part within a few frames."""
SPEAKER_SEED = 99

CODEC_OUTPUT_GAIN = 0.1
"""Brings the tiny codec's noise to RMS ~0.15: audible, not harsh."""

OPTIONS_FILE = "duplex_options.json"
"""Adapter option overrides a checkpoint directory may carry (`Qwen3OmniOptions` fields)."""
RANDOM_WEIGHTS_OPTIONS = {
    "min_text_tokens": 8,
    "max_text_tokens": 24,
    "min_frames": 25,
    "max_frames": 50,
}
"""Random weights end a reply at once; the tiny checkpoint forces 2-4 s of audio per reply."""

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
SEED = 1234


def _mrope(head_dim: int) -> dict:
    half = head_dim // 2
    hw = half // 4
    return {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [half - 2 * hw, hw, hw],
        "interleaved": True,
    }


def tiny_omni_config() -> Qwen3OmniMoeConfig:
    """About 1 M parameters; special ids remapped into the 288-token vocabulary."""
    c2w = tiny_code2wav_config()
    codebook = c2w.codebook_size
    codec_ids = {name: codebook + off for name, off in CODEC_SPECIAL.items()}
    speakers = {name: codebook + len(CODEC_SPECIAL) + i for i, name in enumerate(SPEAKERS)}
    talker_vocab = codebook + TALKER_SUPPRESSED
    head_dim = 16
    mm_ids = {
        "audio_token_id": TOKEN_IDS["<|audio_pad|>"],
        "image_token_id": TOKEN_IDS["<|image_pad|>"],
        "video_token_id": TOKEN_IDS["<|video_pad|>"],
        "audio_start_token_id": TOKEN_IDS["<|audio_start|>"],
    }
    thinker = {
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 2,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "output_dim": 64,
            "n_window": 50,
            "n_window_infer": 800,
            "downsample_hidden_size": 16,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
        "text_config": {
            "vocab_size": THINKER_VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": head_dim,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": _mrope(head_dim),
            "max_position_embeddings": 32768,
        },
        "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
        "user_token_id": TOKEN_IDS["user"],
        **mm_ids,
    }
    talker_hidden = 48
    talker = {
        "text_config": {
            "vocab_size": talker_vocab,
            "hidden_size": talker_hidden,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": _mrope(head_dim),
            "max_position_embeddings": 32768,
        },
        "code_predictor_config": {
            "vocab_size": codebook,
            "hidden_size": talker_hidden,
            "intermediate_size": 96,
            "num_hidden_layers": 1,
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "num_code_groups": c2w.num_quantizers,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        "num_code_groups": c2w.num_quantizers,
        "thinker_hidden_size": 64,
        "accept_hidden_layer": 2,
        "codec_eos_token_id": codec_ids["eos"],
        "codec_nothink_id": codec_ids["nothink"],
        "codec_think_bos_id": codec_ids["think_bos"],
        "codec_think_eos_id": codec_ids["think_eos"],
        "codec_pad_id": codec_ids["pad"],
        "codec_bos_id": codec_ids["bos"],
        "speaker_id": speakers,
        "spatial_merge_size": 2,
        "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
        **mm_ids,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=c2w.to_dict(),
        im_start_token_id=TOKEN_IDS["<|im_start|>"],
        im_end_token_id=TOKEN_IDS["<|im_end|>"],
        tts_pad_token_id=TOKEN_IDS["<|tts_pad|>"],
        tts_bos_token_id=TOKEN_IDS["<|tts_bos|>"],
        tts_eos_token_id=TOKEN_IDS["<|tts_eos|>"],
        system_token_id=TOKEN_IDS["system"],
        user_token_id=TOKEN_IDS["user"],
        assistant_token_id=TOKEN_IDS["assistant"],
    )


def tiny_model() -> Qwen3OmniMoeForConditionalGeneration:
    """The tiny model with seeded weights, so every build is the same checkpoint."""
    config = tiny_omni_config()
    torch.manual_seed(SEED)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    fix_random_init(model)
    with torch.no_grad():
        # At the init's scale a speaker moves the Talker's logits by ~1e-3 and changes no code;
        # rows this large make voices sound apart. A generator of their own, so every other
        # weight stays what SEED made it.
        rows = model.talker.get_input_embeddings().weight
        speakers = torch.Generator().manual_seed(SPEAKER_SEED)
        for index in config.talker_config.speaker_id.values():
            rows[index] = torch.randn(rows.shape[1], generator=speakers) * SPEAKER_STD
    return model


def fix_random_init(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    """Give the parts transformers' init leaves unusable weights that behave like trained ones."""
    std = model.config.talker_config.initializer_range
    with torch.no_grad():
        # transformers' _init_weights covers the Thinker's MoE blocks but not the Talker's: its
        # experts stay torch.empty (whatever memory held) and its routers all-zero.
        for layer in model.talker.model.layers:
            for param in (
                layer.mlp.experts.gate_up_proj,
                layer.mlp.experts.down_proj,
                layer.mlp.gate.weight,
            ):
                param.normal_(0.0, std)
        # With every weight at std 0.02 the deep conv decoder outputs ~1e-7, silence once it is
        # 16-bit PCM; PyTorch's fan-in init keeps the signal's scale through the layers.
        for module in model.code2wav.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d, torch.nn.Linear)):
                module.reset_parameters()
        last = model.code2wav.decoder[-1].conv
        last.weight.mul_(CODEC_OUTPUT_GAIN)
        last.bias.mul_(CODEC_OUTPUT_GAIN)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, so any text round-trips and ids match `TOKEN_IDS`; built locally, no download."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.add_tokens(list(ROLE_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
            "audio_token": "<|audio_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
        },
    )
    got = tok.convert_tokens_to_ids(list(TOKEN_IDS))
    if got != list(TOKEN_IDS.values()):
        raise RuntimeError(f"tiny tokenizer ids drifted: {got}")
    return tok


def preprocessor_config(config: Qwen3OmniMoeConfig) -> dict:
    """What a Qwen3-Omni preprocessor_config.json holds for audio features and image patches."""
    vision = config.thinker_config.vision_config
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": config.thinker_config.audio_config.num_mel_bins,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 30,
        "padding_value": 0.0,
        "dither": 0.0,
        "return_attention_mask": True,
        "image_mean": list(IMAGE_MEAN),
        "image_std": list(IMAGE_STD),
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
    }


def build_tiny(path: str | os.PathLike, progress: Callable[[str], None] | None = None) -> Path:
    """Write a tiny checkpoint directory that `load` (or any from_pretrained) reads back."""
    say = progress or (lambda _msg: None)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    say("building tiny Qwen3-Omni")
    model = tiny_model()
    say(f"saving {sum(p.numel() for p in model.parameters())} parameters to {out}")
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    (out / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(model.config), indent=2)
    )
    (out / OPTIONS_FILE).write_text(json.dumps(RANDOM_WEIGHTS_OPTIONS, indent=2))
    say("tiny checkpoint ready")
    return out


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
) -> Qwen3OmniMoeForConditionalGeneration:
    """Load a local Qwen3-Omni directory (tiny or full) without touching the network."""
    # A directory missing a file must fail here, not start a multi-GB download on a server.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    # With accelerate the weights go straight to the device; without it they pass through host
    # memory, which a 30B checkpoint in bf16 still fits on the serving machines.
    direct = importlib.util.find_spec("accelerate") is not None
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(path), dtype=dtype, device_map=str(device) if direct else None, local_files_only=True
    )
    model = model.to(device).eval()
    if torch.device(device).type == "cpu":
        # CPU weights stay in the safetensors file's mapping at offsets that are not 16-byte
        # aligned, where some kernels round differently than on a freshly built model; own
        # copies are aligned, and rebuilding the directory can no longer pull pages away.
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                tensor.data = tensor.data.clone()
    return model


def load_tokenizer(path: str | os.PathLike):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_options(path: str | os.PathLike) -> dict:
    file = Path(path) / OPTIONS_FILE
    return json.loads(file.read_text()) if file.exists() else {}


def load_preprocessor(path: str | os.PathLike, config: Qwen3OmniMoeConfig) -> dict:
    """The checkpoint's preprocessor_config.json over the defaults derived from `config`."""
    merged = preprocessor_config(config)
    file = Path(path) / "preprocessor_config.json"
    if file.exists():
        merged.update(json.loads(file.read_text()))
    return merged
