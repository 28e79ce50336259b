"""What a Qwen3-Omni adapter may be told: reply lengths, sampling, context sizes, voice."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
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


class Stream:
    """One session's random numbers: its n-th draw is a hash of (seed, n), so what a session
    samples depends on its own seed and draws alone, never on the sessions batched with it,
    and a whole batch draws in a few array operations instead of a call per row."""

    __slots__ = ("key", "drawn")

    def __init__(self, seed: int) -> None:
        self.key = int(_mix(np.array([seed], np.uint64))[0])
        self.drawn = 0


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(streams: list[Stream]) -> np.ndarray:
    """The next draw of each stream, uniform in [0, 1), as float64 (B,)."""
    keys = np.fromiter((s.key for s in streams), np.uint64, len(streams))
    drawn = np.fromiter((s.drawn for s in streams), np.uint64, len(streams))
    for stream in streams:
        stream.drawn += 1
    bits = _mix(keys + (drawn + np.uint64(1)) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def uniform_block(streams: list[Stream], n: int) -> np.ndarray:
    """The next `n` draws of each stream, uniform in [0, 1), as float64 (B, n): noise for a
    sampler that draws a whole frame's codes at once (graphs.py)."""
    keys = np.fromiter((s.key for s in streams), np.uint64, len(streams))[:, None]
    drawn = np.fromiter((s.drawn for s in streams), np.uint64, len(streams))[:, None]
    for stream in streams:
        stream.drawn += n
    bits = _mix(keys + (drawn + np.arange(1, n + 1, dtype=np.uint64)) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def filtered(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logits scaled by the temperature, -inf outside the top-k and top-p sets: what `sample`
    draws from, at fixed shapes and with no host sync, so a CUDA graph can hold it."""
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


def sample(logits: torch.Tensor, sampling: Sampling, streams: list[Stream]) -> torch.Tensor:
    """(B, V) float logits -> (B,) ids; each row draws from its own session's stream."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    ids = None
    # Candidates best first: the top k when there is a k (sorting k, not the vocabulary).
    if 0 < sampling.top_k < logits.shape[-1]:
        logits, ids = logits.topk(sampling.top_k, dim=-1)
    elif sampling.top_p < 1.0:
        logits, ids = logits.sort(dim=-1, descending=True)
    probs = logits.softmax(-1, dtype=torch.float64)
    if sampling.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p, always at least the best token.
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= sampling.top_p, 0.0)
    # Inverse CDF: the first candidate whose cumulative mass passes the row's draw. One of no
    # mass never passes it first; the cap keeps a draw that rounding puts past the total on
    # the last candidate that has mass.
    cdf = probs.cumsum(-1)
    u = torch.from_numpy(uniforms(streams)).to(cdf.device)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    pick = torch.minimum(pick, probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1))
    return pick if ids is None else ids.gather(-1, pick[:, None])[:, 0]


def sample_rows(logits: torch.Tensor, samplings: list[Sampling],
                streams: list[Stream]) -> torch.Tensor:
    """`sample` with a sampling of its own for each row; rows that share one share a call."""
    if len(set(samplings)) == 1:
        return sample(logits, samplings[0], streams)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    groups: dict[Sampling, list[int]] = {}
    for row, sampling in enumerate(samplings):
        groups.setdefault(sampling, []).append(row)
    for sampling, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = sample(logits[index], sampling, [streams[r] for r in rows])
    return out
