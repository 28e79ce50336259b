"""What a Qwen3-Omni adapter may be told: reply lengths, sampling, context sizes, voice."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from models.syncs import upload


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
    """One session's random numbers: its n-th draw is a hash of (seed, n), computed on the
    model's device from the session's key and count of draws, so what a session samples
    depends on its own seed and draws alone, never on the sessions batched with it, and a
    whole batch draws in a few tensor operations (inside a CUDA graph too) with no host noise
    to copy over. The count lives here, on the host: a call uploads it with its inputs and
    adds what it drew, which the host knows from the shapes alone."""

    __slots__ = ("key", "drawn")

    def __init__(self, seed: int) -> None:
        self.key = _signed(_mix_int(seed))
        self.drawn = 0


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on one Python int."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors: int64 products wrap, as uint64 ones do."""
    x = (x ^ _srl(x, 30)) * _signed(_M1)
    x = (x ^ _srl(x, 27)) * _signed(_M2)
    return x ^ _srl(x, 31)


def counters(streams: list[Stream], device) -> torch.Tensor:
    """(2, B) int64 on `device`: each stream's key and draws so far, in one upload."""
    return upload([[s.key for s in streams], [s.drawn for s in streams]], device)


def advance(streams: list[Stream], n: int, drawing: list[bool] | None = None) -> None:
    """Count `n` draws of every stream (of those `drawing` says, when given)."""
    for i, stream in enumerate(streams):
        if drawing is None or drawing[i]:
            stream.drawn += n


def hashed_bits(counts: torch.Tensor, n: int) -> torch.Tensor:
    """(2, B) keys and counts -> (B, n) int64: 64 random bits of each row's next n draws."""
    keys, drawn = counts
    index = drawn[:, None] + torch.arange(1, n + 1, device=counts.device)
    return _mix(keys[:, None] + index * _signed(_GOLDEN))


def uniform64(counts: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) float64 uniforms in [0, 1) on 53 bits."""
    return _srl(hashed_bits(counts, n), 11).double() * 2.0**-53


NOISE_MAX = 1.0 - 2.0**-24
"""The largest float32 below 1: noise that reached 1.0 would make a Gumbel draw +inf, then NaN
on a filtered (-inf) token, and argmax picks NaN: a token outside top-k and top-p."""


def uniform32(counts: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) float32 uniforms on 24 bits, in [0, NOISE_MAX]: every value exact in float32, so
    none rounds up to 1.0 (float64 noise rounded to float32 did)."""
    return _srl(hashed_bits(counts, n), 40).float() * 2.0**-24


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
    return sample_rows(logits, [sampling] * logits.shape[0], streams)


def sample_rows(logits: torch.Tensor, samplings: list[Sampling], streams: list[Stream],
                u: torch.Tensor | None = None) -> torch.Tensor:
    """`sample` with a sampling of its own for each row, with no host sync: rows that differ
    only in temperature (greedy included) share one pass, and a greedy row draws nothing.
    `u`: (B,) uniforms the caller drew and counted already (`uniform64`, `advance`)."""
    device = logits.device
    drawing = [s.temperature > 0 for s in samplings]
    if not any(drawing):
        return logits.argmax(-1)
    kinds = {(s.top_k, s.top_p) for s, d in zip(samplings, drawing, strict=True) if d}
    if len(kinds) > 1:
        return _sample_groups(logits, samplings, streams, u)
    top_k, top_p = kinds.pop()
    temps = [s.temperature if d else 1.0 for s, d in zip(samplings, drawing, strict=True)]
    temperature = (temps[0] if len(set(temps)) == 1
                   else upload(temps, device, logits.dtype)[:, None])
    if u is None:
        u = uniform64(counters(streams, device), 1)[:, 0]
        advance(streams, 1, drawing)
    pick = _inverse_cdf(logits / temperature, top_k, top_p, u)
    if all(drawing):
        return pick
    return torch.where(upload(drawing, device, torch.bool), pick, logits.argmax(-1))


def _inverse_cdf(logits: torch.Tensor, top_k: int, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Tempered logits and (B,) float64 uniforms -> (B,) ids drawn within top-k and top-p."""
    ids = None
    # Candidates best first: the top k when there is a k (sorting k, not the vocabulary).
    if 0 < top_k < logits.shape[-1]:
        logits, ids = logits.topk(top_k, dim=-1)
    elif top_p < 1.0:
        logits, ids = logits.sort(dim=-1, descending=True)
    probs = logits.softmax(-1, dtype=torch.float64)
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p, always at least the best token.
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    # Inverse CDF: the first candidate whose cumulative mass passes the row's draw. One of no
    # mass never passes it first; the cap keeps a draw that rounding puts past the total on
    # the last candidate that has mass.
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    pick = torch.minimum(pick, probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1))
    return pick if ids is None else ids.gather(-1, pick[:, None])[:, 0]


def _sample_groups(logits: torch.Tensor, samplings: list[Sampling], streams: list[Stream],
                   u: torch.Tensor | None) -> torch.Tensor:
    """Rows whose top-k or top-p differ: one pass per kind, each on its rows."""
    groups: dict[tuple[int, float], list[int]] = {}
    for row, s in enumerate(samplings):
        groups.setdefault((s.top_k, s.top_p) if s.temperature > 0 else (0, 1.0), []).append(row)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for rows in groups.values():
        index = upload(rows, logits.device)
        out.index_copy_(0, index, sample_rows(
            logits.index_select(0, index), [samplings[r] for r in rows],
            [streams[r] for r in rows], None if u is None else u.index_select(0, index)))
    return out
