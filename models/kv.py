"""Key/value caches that let sessions of different context lengths share one forward.

Two layouts, one per way an adapter runs its transformers:

- `SlotKV`: one buffer per layer with a row (slot) per session, handed to a transformers model
  as its `cache=` object (`bind`). Rows keep their own lengths; a call writes each row's new keys
  at that row's length and attends under an explicit 4D mask. Each slot records its owner and
  every call checks it, so a reused slot can never feed one session's context to another.
  Qwen3-Omni's Thinker and Talker use it.
- `SlidingKV`: each session owns its buffer, kept in time order and bounded by an attention
  window; `KVBatch` stacks several of them for one forward of layers the adapter steps itself.
  Moshi's decoders and Mimi's transformers use it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.nn.functional as F

from models.prefix_cache import PrefixKV


class SlotOwnershipError(RuntimeError):
    """A state reached a slot that another session owns now; nothing was computed."""


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in `obj`, looking inside lists, tuples and deques; others count 0."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple, deque)):
        return sum(tensor_bytes(x) for x in obj)
    return 0


class SlotKV:
    """KV of many sessions in one buffer per layer: (slots, kv_heads, capacity, head_dim).

    Rows are claimed per session and released whole; when rows at the end or the longest
    context go away the buffers shrink, and an empty pool holds no memory at all.
    """

    def __init__(self, layers: int, heads: int, head_dim: int, device, dtype) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.device, self.dtype = device, dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.owner: list[str | None] = []
        self.length: list[int] = []
        self.capacity = 0

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.keys) + tensor_bytes(self.values)

    def slot_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.heads * self.capacity * self.head_dim * itemsize

    def acquire(self, owner: str) -> int:
        if None in self.owner:
            slot = self.owner.index(None)
        else:
            slot = len(self.owner)
            self._resize(max(1, 2 * len(self.owner)), self.capacity)
        self.owner[slot] = owner
        self.length[slot] = 0
        return slot

    def release(self, slot: int, owner: str) -> None:
        self.check(slot, owner)
        self.owner[slot] = None
        self.length[slot] = 0
        used = [i for i, o in enumerate(self.owner) if o is not None]
        if not used:
            self.keys, self.values, self.owner, self.length, self.capacity = [], [], [], [], 0
            return
        rows = used[-1] + 1
        capacity = _round_up(max(self.length[i] for i in used))
        if rows < len(self.owner) or capacity < self.capacity // 2:
            self._resize(rows, capacity)

    def check(self, slot: int, owner: str) -> None:
        if slot >= len(self.owner) or self.owner[slot] != owner:
            held = self.owner[slot] if slot < len(self.owner) else None
            raise SlotOwnershipError(f"slot {slot} belongs to {held!r}, not {owner!r}")

    def read(self, slot: int, n: int) -> PrefixKV:
        """A copy of the slot's first `n` positions (for the prefix cache)."""
        return PrefixKV(tuple(k[slot, :, :n].clone() for k in self.keys),
                        tuple(v[slot, :, :n].clone() for v in self.values))

    def write(self, slot: int, prefix: PrefixKV) -> None:
        """Make a freshly acquired slot hold `prefix` as its first positions."""
        if self.length[slot]:
            raise ValueError(f"slot {slot} already holds {self.length[slot]} positions")
        n = prefix.length
        if n > self.capacity:
            self._resize(len(self.owner), _round_up(n))
        for bufs, parts in ((self.keys, prefix.keys), (self.values, prefix.values)):
            for buf, part in zip(bufs, parts, strict=True):
                buf[slot, :, :n] = part
        self.length[slot] = n

    def truncate(self, slot: int, owner: str, n: int) -> None:
        """Rewind the slot to its first `n` positions; the rest is forgotten."""
        self.check(slot, owner)
        if not 0 <= n <= self.length[slot]:
            raise ValueError(f"slot {slot} holds {self.length[slot]} positions, not {n}")
        self.length[slot] = n

    def evict(self, slot: int, keep: int, drop: int) -> None:
        """Remove `drop` positions after the first `keep`; later keys keep their rotary phase."""
        end = self.length[slot]
        for buf in (*self.keys, *self.values):
            buf[slot, :, keep : end - drop] = buf[slot, :, keep + drop : end].clone()
        self.length[slot] = end - drop

    def _resize(self, rows: int, capacity: int) -> None:
        shape = (rows, self.heads, capacity, self.head_dim)
        old_rows = min(rows, len(self.owner))
        old_cap = min(capacity, self.capacity)
        for bufs in (self.keys, self.values):
            for i in range(self.layers):
                new = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if i < len(bufs):
                    new[:old_rows, :, :old_cap] = bufs[i][:old_rows, :, :old_cap]
                    bufs[i] = new
                else:
                    bufs.append(new)
        self.owner = (self.owner + [None] * rows)[:rows]
        self.length = (self.length + [0] * rows)[:rows]
        self.capacity = capacity

    def bind(self, slots: list[int], owners: list[str], new: list[int]) -> _BoundKV:
        """Prepare one forward: row b appends `new[b]` positions to slot `slots[b]`."""
        for slot, owner in zip(slots, owners, strict=True):
            self.check(slot, owner)
        q = max(new)
        need = max(self.length[s] for s in slots) + q
        if need > self.capacity:
            self._resize(len(self.owner), max(_round_up(need), 2 * self.capacity))
        return _BoundKV(self, slots, new, q)


def _round_up(n: int, step: int = 64) -> int:
    return max(step, -(-n // step) * step)


class _BoundKV:
    """The `cache=` object of one forward: per-row writes, reads up to the longest row."""

    def __init__(self, pool: SlotKV, slots: list[int], new: list[int], q: int) -> None:
        self.pool, self.slots, self.new = pool, slots, new
        device = pool.device
        starts = torch.tensor([pool.length[s] for s in slots], device=device)
        self.rows = torch.tensor(slots, device=device)[:, None].expand(-1, q)
        self.positions = starts[:, None] + torch.arange(q, device=device)
        self.kv_len = max(pool.length[s] for s in slots) + q
        first = slots[0]
        # Rows in ascending adjacent slots read the pool as a view; others gather a copy.
        self.span = (
            (first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None
        )
        kv_index = torch.arange(self.kv_len, device=device)
        allowed = kv_index[None, None, :] <= self.positions[:, :, None]
        self.mask = torch.zeros(allowed.shape, device=device, dtype=pool.dtype)
        self.mask.masked_fill_(~allowed, torch.finfo(pool.dtype).min)
        self.mask = self.mask[:, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        keys[self.rows, :, self.positions] = key.transpose(1, 2).to(keys.dtype)
        values[self.rows, :, self.positions] = value.transpose(1, 2).to(values.dtype)
        if self.span is not None:
            lo, hi = self.span
            return keys[lo:hi, :, : self.kv_len], values[lo:hi, :, : self.kv_len]
        index = self.rows[:, 0]
        return keys[index, :, : self.kv_len], values[index, :, : self.kv_len]

    def commit(self) -> None:
        for slot, n in zip(self.slots, self.new, strict=True):
            self.pool.length[slot] += n


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
