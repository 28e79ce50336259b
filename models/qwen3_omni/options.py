"""What a Qwen3-Omni adapter may be told: reply lengths, sampling, context sizes, voice."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class Qwen3OmniOptions:
    min_text_tokens: int = 1
    max_text_tokens: int = 512
    min_frames: int = 1
    max_frames: int = 1500
    thinker_sampling: Sampling = Sampling()
    # generate()'s Talker defaults; its code predictor samples with top_k 50, top_p 0.8.
    talker_sampling: Sampling = Sampling(0.9, 50, 1.0)
    residual_sampling: Sampling = Sampling(1.0, 50, 0.8)
    seed: int = 0
    speaker: str = "ethan"
    system_prompt: str | None = None
    max_context: int = 8192
    """Thinker positions kept per session. Past it the oldest positions after the system prompt
    are evicted, a quarter of the context at a time, so a long call keeps going instead of
    failing when a buffer fills."""
    talker_context: int = 512
    """User-turn positions the Talker is prefilled with at each reply (generate uses all)."""
    audio_chunk_samples: int | None = None
    """None: one conv chunk of the audio tower (n_window * 2 mel frames, 1 s), so a chunk sees
    exactly the convolution input it would see offline."""
    video_max_pixels: int = 448 * 448


def sample(logits: torch.Tensor, sampling: Sampling, gens: list[torch.Generator]) -> torch.Tensor:
    """(B, V) float logits -> (B,) ids; each row draws from its own session's generator."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    probs = filtered(logits, sampling).softmax(-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(gens)])


def filtered(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logits scaled by the temperature, -inf outside the top-k and top-p sets. Fixed shapes and
    no host sync, so a CUDA graph can hold it."""
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p, always at least the best token.
        drop = cum - sorted_logits.softmax(-1) >= sampling.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    return logits


def sample_rows(logits: torch.Tensor, samplings: list[Sampling],
                gens: list[torch.Generator]) -> torch.Tensor:
    """`sample` with a sampling of its own for each row; rows that share one share a call."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    groups: dict[Sampling, list[int]] = {}
    for row, sampling in enumerate(samplings):
        groups.setdefault(sampling, []).append(row)
    for sampling, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = sample(logits[index], sampling, [gens[r] for r in rows])
    return out
