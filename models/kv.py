"""Key/value caches that let sessions of different context lengths share one forward.

Two layouts, one per way an adapter runs its transformers:

- Paged (`models.paged_kv`): one pool of blocks per transformer, a block table per session,
  handed to a transformers model as its `cache=` object. Qwen3-Omni's Thinker and Talker use it.
- `SlidingKV` (here): each session owns its buffer, kept in time order and bounded by an
  attention window; `KVBatch` stacks several of them for one forward of layers the adapter
  steps itself. Moshi's decoders and Mimi's transformers use it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.nn.functional as F


class SlotOwnershipError(RuntimeError):
    """A state reached a slot that another session owns now; nothing was computed."""


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj`, looking inside lists, tuples and deques; others count 0."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple, deque)):
        return sum(tensor_bytes(x) for x in obj)
    return 0


class SlidingKV:
    """Keys and values of every layer of one transformer for `rows` sequences advancing together.

    Entries stay in time order in one buffer per tensor, shaped (layers, rows, kv_heads, capacity,
    head_dim). When the buffer is full, entries older than the attention window are dropped, so
    memory is bounded by the window rather than by how long a session lasts. `seen` counts every
    position ever appended: it is the absolute (RoPE) position of the next entry.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        window: int,
        rows: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.shape = (n_layers, rows, n_kv_heads, head_dim)
        self.window = window
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self.seen = 0

    @property
    def rows(self) -> int:
        return self.shape[1]

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def release(self) -> None:
        self.k = self.v = None
        self.length = 0

    def reserve(self, n: int) -> None:
        """Make room to append `n` entries, keeping the last `window - 1` that can still be seen."""
        if self.length + n <= self.capacity:
            return
        keep = min(self.length, self.window - 1)
        need = keep + n
        # Slack past the window makes the O(window) shift happen once per ~window/4 positions.
        slack = max(8, self.window // 4)
        start = self.length - keep
        if self.capacity >= need + slack:
            self.k[:, :, :, :keep] = self.k[:, :, :, start : self.length].clone()
            self.v[:, :, :, :keep] = self.v[:, :, :, start : self.length].clone()
        else:
            capacity = max(need, min(max(2 * self.capacity, 16), self.window - 1 + n + slack))
            layers, rows, heads, dim = self.shape
            # Zeros, not empty: masked-out entries are still multiplied by a zero weight.
            k = torch.zeros(
                layers, rows, heads, capacity, dim, dtype=self.dtype, device=self.device
            )
            v = torch.zeros_like(k)
            if keep:
                k[:, :, :, :keep] = self.k[:, :, :, start : self.length]
                v[:, :, :, :keep] = self.v[:, :, :, start : self.length]
            self.k, self.v = k, v
        self.length = keep


class KVBatch:
    """One forward over several `SlidingKV`s: each appends `n` entries at its own length.

    Rows of different lengths share one key axis of width max(length) + n; the mask lets query q
    of a row see its own entries j with 0 <= length + q - j < window, which covers both the
    right padding of shorter rows and the sliding window.
    """

    def __init__(self, kvs: list[SlidingKV], n: int):
        for kv in kvs:
            kv.reserve(n)
        self.kvs = kvs
        self.n = n
        self.lengths = [kv.length for kv in kvs]
        self.width = max(self.lengths) + n
        device = kvs[0].device
        # One small tensor built from Python ints: this runs per layer stack and frame, where a
        # handful of tensor ops more is a noticeable share of a tiny model's step.
        first = torch.tensor(
            [[kv.length, kv.seen] for kv in kvs for _ in range(kv.rows)], device=device
        )[:, :, None] + torch.arange(n, device=device)
        delta = first[:, 0, :, None] - torch.arange(self.width, device=device)
        self.mask = ((delta >= 0) & (delta < kvs[0].window))[:, None]
        self.position_ids = first[:, 1]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q (rows, heads, n, dim), k and v (rows, kv_heads, n, dim) -> (rows, heads, n, dim)."""
        row = 0
        for kv, length in zip(self.kvs, self.lengths, strict=True):
            kv.k[layer, :, :, length : length + self.n] = k[row : row + kv.rows]
            kv.v[layer, :, :, length : length + self.n] = v[row : row + kv.rows]
            row += kv.rows
        if len(self.kvs) == 1:
            keys = self.kvs[0].k[layer, :, :, : self.width]
            values = self.kvs[0].v[layer, :, :, : self.width]
        else:
            keys = k.new_zeros(row, k.shape[1], self.width, k.shape[3])
            values = torch.zeros_like(keys)
            row = 0
            for kv, length in zip(self.kvs, self.lengths, strict=True):
                end = length + self.n
                keys[row : row + kv.rows, :, :end] = kv.k[layer, :, :, :end]
                values[row : row + kv.rows, :, :end] = kv.v[layer, :, :, :end]
                row += kv.rows
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    def commit(self, counts: list[int] | None = None) -> None:
        """Keep the first `counts[i]` new entries of each `SlidingKV` (all `n` by default)."""
        for i, kv in enumerate(self.kvs):
            added = self.n if counts is None else counts[i]
            kv.length += added
            kv.seen += added


class StepKV:
    """Keys and values of a short run that every row steps through alike, one position at a
    time (Moshi's depth decoder over the codebooks of one frame): no padding and no window, so
    attention needs no mask and the cache is rebuilt per run rather than kept."""

    position_ids = None

    def __init__(self, layers: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q (rows, heads, 1, dim), k and v (rows, kv_heads, 1, dim) -> (rows, heads, 1, dim)."""
        self.k[layer].append(k)
        self.v[layer].append(v)
        keys, values = torch.cat(self.k[layer], dim=2), torch.cat(self.v[layer], dim=2)
        return F.scaled_dot_product_attention(
            q, keys, values, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
