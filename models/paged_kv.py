"""Paged KV: one pool of fixed-size blocks per transformer, a block table per session.

The pool is allocated once, when the adapter is built, from a memory budget: keys and values of
every layer, (layers, kv_heads, positions, head_dim) each, the positions axis cut into blocks of
`block_size`. A session (a slot of the pool) lists the blocks that hold its positions in order:
position p lives in block `table[slot][p // block_size]` at offset `p % block_size`. A context
grows a block at a time and gives blocks back when it is cut or closed; nothing is padded to
another session's length, resized or zero-filled.

Blocks are reference counted, so several slots (and the prefix cache, `models.prefix_cache`)
can hold the same block: a cached context head is shared by reference, and a slot about to
write into a block others hold copies it first (copy on write).

Block 0 is never handed out: a forward's padded positions are written there, and the gather
below reads it where a row has no position.

Each slot records its owner and every call checks it, so a reused slot can never feed one
session's context to another. A forward binds the batch's slots (`bind`): the `cache=` object
writes each row's new keys in its blocks and hands attention what it needs to read them
(`models.paged_attention`).

Host-to-device traffic: the per-forward metadata (each row's block table, start and new
length) is written into a host buffer and copied once, without a sync; everything else
(write addresses, read addresses, masks) is derived on the device. No device value is read
back here, so nothing in this module makes the host wait for the device.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from models.kv import SlotOwnershipError
from models.syncs import sent

BLOCK_SIZE = 64
"""Positions per block: a multiple of the attention kernels' tile (FlexAttention reads a block
as one sparse KV block). At Qwen3-Omni-30B-A3B's widths a Thinker block is 6 MiB."""

TRASH = 0
"""The block padded positions are written to and empty positions read from."""

_uids = itertools.count()


class KVExhausted(RuntimeError):
    """No free block: a caller allocated past what it reserved. A bug, never a user's error;
    callers check `available` and reserve before they bind."""


class Spare(Protocol):
    """Blocks held by someone who can give them up when the pool runs short (the prefix
    cache's entries no session uses)."""

    def reclaimable(self, pool: PagedKV) -> int: ...

    def reclaim(self, pool: PagedKV, blocks: int) -> None: ...


@dataclass(frozen=True)
class Layout:
    layers: int
    heads: int
    head_dim: int
    itemsize: int

    @property
    def position_bytes(self) -> int:
        """Keys and values of one position in every layer."""
        return 2 * self.layers * self.heads * self.head_dim * self.itemsize


class _Staging:
    """Host buffers the per-forward metadata is written into and their device copies.

    On a CUDA device the host side is pinned and copied without blocking; a ring of buffers
    keeps a copy still in flight from being overwritten by the next forward's metadata (an
    event per buffer says when its copy has run). On the CPU the device tensor is the host
    buffer itself. Either way the tensors are made once, so a forward builds no tensor from
    Python data."""

    RING = 4

    def __init__(self, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.device = device
        self.host = [torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
                     for _ in range(self.RING)]
        self.views = [h.numpy() for h in self.host]
        self.dev = [torch.zeros(size, dtype=torch.int64, device=device) if cuda else h
                    for h in self.host]
        self.events: list[torch.cuda.Event | None] = [None] * self.RING
        self.at = 0

    def take(self) -> int:
        """The next buffer of the ring, free to write."""
        self.at = (self.at + 1) % self.RING
        event = self.events[self.at]
        if event is not None:
            event.synchronize()
        return self.at

    def send(self, i: int, n: int) -> torch.Tensor:
        """The first `n` values of buffer `i` on the device."""
        if self.device.type != "cuda":
            return sent(self.dev[i][:n])
        self.dev[i][:n].copy_(self.host[i][:n], non_blocking=True)
        event = self.events[i] = self.events[i] or torch.cuda.Event()
        event.record()
        return sent(self.dev[i][:n])


class PagedKV:
    """Keys and values of many sessions in blocks of one pool, for one transformer."""

    def __init__(self, layers: int, heads: int, head_dim: int, device, dtype, blocks: int,
                 max_positions: int, block_size: int = BLOCK_SIZE,
                 attention: str = "gather") -> None:
        """`blocks` usable blocks (block 0 comes on top); `max_positions` a slot may hold;
        `attention`: "flex" (read blocks in place) or "gather" (`models.paged_attention`)."""
        if blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, not {blocks}")
        if attention not in ("flex", "gather"):
            raise ValueError(f"attention is flex or gather, not {attention!r}")
        self.uid = next(_uids)
        self.device, self.dtype = torch.device(device), dtype
        self.layout = Layout(layers, heads, head_dim, torch.empty((), dtype=dtype).element_size())
        self.block_size, self.blocks_total = block_size, blocks
        self.max_blocks = math.ceil(max_positions / block_size)
        self.attention = attention
        shape = (layers, heads, (blocks + 1) * block_size, head_dim)
        # FlexAttention multiplies masked positions of a block it reads by a zero weight: they
        # must hold numbers. The gather reads only written positions and the trash block; on
        # the CPU `empty` costs no memory until a block is used.
        fill = torch.zeros if attention == "flex" else torch.empty
        self.keys = fill(shape, device=self.device, dtype=dtype)
        self.values = fill(shape, device=self.device, dtype=dtype)
        for buf in (self.keys, self.values):
            buf[:, :, : block_size].zero_()
        # The lowest blocks first: on the CPU a small load touches a small part of the pool.
        self.free = list(range(blocks, TRASH, -1))
        self.refs = np.zeros(blocks + 1, dtype=np.int32)
        self.logical = np.full(blocks + 1, -1, dtype=np.int64)
        """Each block's index in the slots that hold it (shared blocks sit at the same index
        in every holder: they are a common prefix)."""
        self._logical_dev: torch.Tensor | None = None
        self._logical_staging: _Staging | None = None
        self._logical_version = self._logical_sent = 0
        self.owner: list[str | None] = []
        self.length: list[int] = []
        self.rows: list[list[int]] = []
        self.reserved: dict[str, int] = {}
        self.spare: Spare | None = None
        self._staging: _Staging | None = None
        self._trash = torch.arange(block_size, device=self.device)

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.layout.position_bytes

    @property
    def nbytes(self) -> int:
        """What the pool allocated, block 0 included."""
        return self.keys.nbytes + self.values.nbytes

    @property
    def blocks_used(self) -> int:
        return self.blocks_total - len(self.free)

    def slot_bytes(self, slot: int) -> int:
        """Bytes of the blocks only this slot holds (shared ones are their cache entry's)."""
        return self.private_blocks(slot) * self.block_bytes

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # ---- reservations ------------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Blocks a new need may still take: free ones, and those a spare would give up,
        less what is reserved."""
        spare = self.spare.reclaimable(self) if self.spare is not None else 0
        return len(self.free) + spare - sum(self.reserved.values())

    def reserve(self, owner: str, blocks: int) -> bool:
        """Promise `owner` `blocks` more blocks, taken from nobody else until it uses them
        or gives them back (`unreserve`); False, promising nothing, when they are not there."""
        if blocks <= 0:
            return True
        if blocks > self.available:
            return False
        self.reserved[owner] = self.reserved.get(owner, 0) + blocks
        return True

    def unreserve(self, owner: str) -> None:
        self.reserved.pop(owner, None)

    # ---- slots -------------------------------------------------------------------------------

    def acquire(self, owner: str) -> int:
        if None in self.owner:
            slot = self.owner.index(None)
        else:
            slot = len(self.owner)
            self.owner.append(None)
            self.length.append(0)
            self.rows.append([])
        self.owner[slot], self.length[slot], self.rows[slot] = owner, 0, []
        return slot

    def release(self, slot: int, owner: str) -> None:
        """Give back the slot, its blocks and its owner's reservation."""
        self.check(slot, owner)
        self._drop(self.rows[slot])
        self.owner[slot], self.length[slot], self.rows[slot] = None, 0, []
        self.unreserve(owner)

    def check(self, slot: int, owner: str) -> None:
        if slot >= len(self.owner) or self.owner[slot] != owner:
            held = self.owner[slot] if slot < len(self.owner) else None
            raise SlotOwnershipError(f"slot {slot} belongs to {held!r}, not {owner!r}")

    def slots(self) -> list[int]:
        return [s for s, o in enumerate(self.owner) if o is not None]

    # ---- blocks ------------------------------------------------------------------------------

    def _take(self, owner: str, logical: int) -> int:
        if not self.free and self.spare is not None:
            self.spare.reclaim(self, 1)
        if not self.free:
            raise KVExhausted(f"no free KV block for {owner!r} ({self.blocks_total} in the pool)")
        block = self.free.pop()
        self.refs[block] = 1
        self._place(block, logical)
        left = self.reserved.get(owner, 0)
        if left > 1:
            self.reserved[owner] = left - 1
        elif left:
            del self.reserved[owner]
        return block

    def _place(self, block: int, logical: int) -> None:
        if self.logical[block] != logical:
            self.logical[block] = logical
            self._logical_version += 1

    def _drop(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
                self._place(block, -1)

    def drop(self, blocks: tuple[int, ...]) -> None:
        """Give back references taken with `hold` (a prefix cache entry evicted)."""
        self._drop(list(blocks))

    def hold(self, slot: int, n: int) -> tuple[int, ...]:
        """A reference to the blocks holding the slot's first `n` positions (for the prefix
        cache); the slot copies a shared block before it writes into it."""
        blocks = tuple(self.rows[slot][: self.blocks_for(n)])
        for block in blocks:
            self.refs[block] += 1
        return blocks

    def share(self, slot: int, blocks: tuple[int, ...], n: int) -> None:
        """Make a fresh slot hold `n` positions in `blocks`, by reference."""
        if self.length[slot]:
            raise ValueError(f"slot {slot} already holds {self.length[slot]} positions")
        for block in blocks:
            self.refs[block] += 1
        self.rows[slot] = list(blocks)
        self.length[slot] = n

    def blocks_needed(self, slot: int, n: int) -> int:
        """Blocks the slot must take to append `n` positions (a shared block it writes into
        counts: it is copied first)."""
        length, row = self.length[slot], self.rows[slot]
        new = self.blocks_for(length + n) - len(row)
        partial = length % self.block_size and n > 0
        return new + int(bool(partial) and self.refs[row[length // self.block_size]] > 1)

    def private_blocks(self, slot: int) -> int:
        return sum(int(self.refs[b] == 1) for b in self.rows[slot])

    def _ensure(self, slot: int, end: int) -> None:
        """Blocks for the slot's positions up to `end`, the one it writes into next its own."""
        owner, row, length = self.owner[slot], self.rows[slot], self.length[slot]
        need = self.blocks_for(end)
        if need > self.max_blocks:
            raise ValueError(f"slot {slot} would hold {end} positions, past its "
                             f"{self.max_blocks * self.block_size}")
        at = length // self.block_size
        if length % self.block_size and end > length and self.refs[row[at]] > 1:
            self._copy_block(slot, at)
        while len(row) < need:
            row.append(self._take(owner, len(row)))

    def _copy_block(self, slot: int, at: int) -> None:
        row, bs = self.rows[slot], self.block_size
        old = row[at]
        new = self._take(self.owner[slot], at)
        for buf in (self.keys, self.values):
            buf[:, :, new * bs : (new + 1) * bs].copy_(buf[:, :, old * bs : (old + 1) * bs])
        self.refs[old] -= 1
        row[at] = new

    def truncate(self, slot: int, owner: str, n: int) -> None:
        """Keep the slot's first `n` positions and give back the blocks past them (a context
        rewound to re-prefill from position n)."""
        self.check(slot, owner)
        if not 0 <= n <= self.length[slot]:
            raise ValueError(f"slot {slot} holds {self.length[slot]} positions, cannot keep {n}")
        keep = self.blocks_for(n)
        self._drop(self.rows[slot][keep:])
        del self.rows[slot][keep:]
        self.length[slot] = n

    def addresses(self, slot: int, start: int, end: int) -> np.ndarray:
        """Where the slot's positions start..end-1 lie on the pool's positions axis."""
        pos = np.arange(start, end)
        row = np.asarray(self.rows[slot], dtype=np.int64)
        return row[pos // self.block_size] * self.block_size + pos % self.block_size

    def evict(self, slot: int, keep: int, drop: int) -> None:
        """Remove `drop` positions after the first `keep`; later keys keep their rotary phase
        and move up to fill the gap, and the blocks left empty are given back."""
        end = self.length[slot]
        moved = end - keep - drop
        # Every block from the one holding `keep` on is the slot's own: it copied a shared one
        # when it first wrote past `keep`, and positions past `keep` are all it moves.
        if moved > 0:
            staging = self._staging_for(2 * moved)
            i = staging.take()
            view = staging.views[i]
            view[:moved] = self.addresses(slot, keep + drop, end)
            view[moved : 2 * moved] = self.addresses(slot, keep, keep + moved)
            index = staging.send(i, 2 * moved)
            src, dst = index[:moved], index[moved:]
            for buf in (self.keys, self.values):
                buf[:, :, dst] = buf[:, :, src]
        self.truncate(slot, self.owner[slot], end - drop)

    # ---- one forward -------------------------------------------------------------------------

    def _staging_for(self, size: int) -> _Staging:
        if self._staging is None or self._staging.host[0].numel() < size:
            self._staging = _Staging(max(size, 1024), self.device)
        return self._staging

    def logical_index(self) -> torch.Tensor:
        """Each block's index in its slots, on the device (-1 for a free block), sent again
        only after it changed."""
        if self._logical_dev is None or self._logical_sent != self._logical_version:
            if self._logical_staging is None:
                self._logical_staging = _Staging(self.blocks_total + 1, self.device)
            staging = self._logical_staging
            i = staging.take()
            staging.views[i][:] = self.logical
            self._logical_dev = staging.send(i, self.blocks_total + 1)
            self._logical_sent = self._logical_version
        return self._logical_dev

    def plan(self, slots: list[int], owners: list[str], new: list[int]) -> Meta:
        """The host's part of one forward in which row b appends `new[b]` positions to slot
        `slots[b]`: owners checked, blocks taken (a shared block a row writes into copied
        first, here, before any kernel of the forward), the rows' metadata sent."""
        for slot, owner in zip(slots, owners, strict=True):
            self.check(slot, owner)
        for slot, n in zip(slots, new, strict=True):
            self._ensure(slot, self.length[slot] + n)
        batch, width = len(slots), self.max_blocks
        staging = self._staging_for(batch * (width + 2))
        i = staging.take()
        view = staging.views[i]
        table = view[: batch * width].reshape(batch, width)
        table[:] = TRASH
        for b, slot in enumerate(slots):
            row = self.rows[slot]
            table[b, : len(row)] = row
        starts = [self.length[s] for s in slots]
        view[batch * width : batch * (width + 1)] = starts
        view[batch * (width + 1) : batch * (width + 2)] = new
        sent = staging.send(i, batch * (width + 2))
        return Meta(
            table=sent[: batch * width].view(batch, width),
            start=sent[batch * width : batch * (width + 1)],
            new=sent[batch * (width + 1) :],
            q=max(new),
            kv_len=max(s + n for s, n in zip(starts, new, strict=True)),
        )

    def bind(self, slots: list[int], owners: list[str], new: list[int]) -> BoundKV:
        """Prepare one forward (`plan`) and the `cache=` object it runs with."""
        return BoundKV(self, slots, new, self.plan(slots, owners, new))

    def commit(self, slots: list[int], new: list[int]) -> None:
        """A planned forward ran: each slot holds its new positions."""
        for slot, n in zip(slots, new, strict=True):
            self.length[slot] += n

    def write_addresses(self, meta: Meta) -> torch.Tensor:
        """(B * q,) where each row's new positions go on the positions axis, derived on the
        device; padding goes to the trash block, one address per column so no two rows of a
        column collide."""
        bs = self.block_size
        t = torch.arange(meta.q, device=self.device)
        pos = meta.start[:, None] + t
        real = t[None] < meta.new[:, None]
        block = meta.table.gather(1, (pos // bs).clamp(max=self.max_blocks - 1))
        return torch.where(real, block * bs + pos % bs, self._trash[t % bs]).flatten()


@dataclass(frozen=True)
class Meta:
    """A forward's rows on the device: block tables (B, max_blocks), start and new lengths
    (B,); and on the host the longest query and key extents."""

    table: torch.Tensor
    start: torch.Tensor
    new: torch.Tensor
    q: int
    kv_len: int


class PagedCache:
    """What a forward's `cache=` object does with the pool: every layer's update writes the
    rows' new keys and values at `write` and hands attention what it reads: the whole pool
    (FlexAttention, `read` None) or the positions `read` lists (the gather)."""

    pool: PagedKV
    write: torch.Tensor
    read: torch.Tensor | None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value (B, kv_heads, q, head_dim) -> what attention reads for this layer."""
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        heads, dim = keys.shape[0], keys.shape[2]
        for buf, new in ((keys, key), (values, value)):
            rows = new.transpose(0, 1).reshape(heads, -1, dim)
            buf.index_copy_(1, self.write, rows.to(buf.dtype))
        if self.read is None:
            return keys[None], values[None]
        # (kv_heads, B, kv_len, head_dim) -> (B, kv_heads, kv_len, head_dim)
        return keys[:, self.read].transpose(0, 1), values[:, self.read].transpose(0, 1)


class BoundKV(PagedCache):
    """The `cache=` object of one planned forward (`PagedKV.bind`)."""

    def __init__(self, pool: PagedKV, slots: list[int], new: list[int], meta: Meta) -> None:
        from models.paged_attention import attention_inputs

        self.pool, self.slots, self.new, self.meta = pool, slots, new, meta
        self.write = pool.write_addresses(meta)
        self.read, self.mask = attention_inputs(pool, meta)

    def commit(self) -> None:
        self.pool.commit(self.slots, self.new)


def session_bytes(position_bytes: tuple[int, ...], positions: tuple[int, ...],
                  block_size: int = BLOCK_SIZE) -> int:
    """Bytes of one session at full length in every pool, in whole blocks."""
    return sum(b * -(-p // block_size) * block_size
               for b, p in zip(position_bytes, positions, strict=True))


def split_budget(total_bytes: int, position_bytes: tuple[int, ...],
                 positions: tuple[int, ...], block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    """Blocks of each pool from one byte budget, split so that every pool holds the same
    number of sessions at its `positions` (a full context, a full reply), and at least one."""
    per_session = session_bytes(position_bytes, positions, block_size)
    sessions = max(1.0, total_bytes / max(per_session, 1))
    return tuple(math.ceil(sessions * -(-p // block_size) - 1e-9) for p in positions)
