"""One decode step (one position per row) of a transformers text model over a paged KV pool
(`models.paged_kv`), every tensor allocated up front for a batch bucket: what a CUDA graph of
the step holds (`models.cuda_graphs`).

A graph replays fixed shapes at fixed addresses with no host read inside, so everything a step
varies lives in buffers filled in place before the replay: the rows' input embeddings and
M-RoPE positions, their block tables at the pool's full width (`max_blocks`) and their lengths.
From those the step derives on the device, inside the graph, where each row writes its new key
and what attention reads, in shapes that never depend on a row's length:

- FlexAttention (the CUDA pool's): the BlockMask is made once per bucket over buffers of its
  own (block counts and indices, the rows' tables and lengths, each block's index in its
  slots); the step recomputes the counts and indices into them (`block_tensors`), and the
  compiled kernel visits only each row's own blocks, whatever the pool's size.
- The gather (the CPU's): every row reads its table's whole width under a mask, so the read
  never depends on the longest row.

Rows past the batch are padding: an empty table (all the trash block) and length 0, so each
writes its one position into the trash block and reads it back (the block's index is 0 for
them alone: a real row's table never lists it), and its output is never read. A padding row
never attends to nothing: kernels answer a fully masked row differently (zeros or NaN). The host's part
of a step (owner checks, taking blocks, copying a shared block before it is written into,
sending the tables) is the pool's `plan`, run before the buffers are loaded; its `commit` after.
"""

from __future__ import annotations

import torch

from models.paged_attention import (
    attention_inputs,
    block_tensors,
    make_block_mask,
    paged_mask_mod,
)
from models.paged_kv import TRASH, Meta, PagedCache, PagedKV


class StaticKV(PagedCache):
    """The `cache=` object of a bucket's decode step, in fixed buffers."""

    def __init__(self, pool: PagedKV, batch: int) -> None:
        device, width = pool.device, pool.max_blocks
        self.pool = pool
        self.table = torch.full((batch, width), TRASH, dtype=torch.long, device=device)
        self.start = torch.zeros(batch, dtype=torch.long, device=device)
        self.new = torch.ones(batch, dtype=torch.long, device=device)
        self.end = torch.ones(batch, dtype=torch.long, device=device)
        self.meta = Meta(self.table, self.start, self.new, q=1, kv_len=width * pool.block_size)
        self.write = pool.write_addresses(self.meta)
        self.read: torch.Tensor | None = None
        self.block_mask = None
        self._logical_from: torch.Tensor | None = None
        if pool.attention == "flex":
            self.logical = torch.zeros(pool.blocks_total + 1, dtype=torch.long, device=device)
            self.blocks = block_tensors(pool, self.table, self.start, self.end, 1)
            self.block_mask = make_block_mask(pool, 1, self.blocks, paged_mask_mod(
                pool, self.logical, self.table, self.start, self.end))
        self.mask = self.block_mask

    def load(self, meta: Meta, rows: int) -> None:
        """A planned step of `rows` rows (device to device); the rows past them padding."""
        if meta.q != 1:
            raise ValueError(f"a static step appends one position per row, not {meta.q}")
        self.table[:rows].copy_(meta.table)
        self.table[rows:].fill_(TRASH)
        self.start[:rows].copy_(meta.start)
        self.start[rows:].zero_()
        if self.block_mask is not None:
            logical = self.pool.logical_index()
            # The pool sends a new tensor only when a block changed hands.
            if logical is not self._logical_from:
                self.logical.copy_(logical)
                self.logical[TRASH : TRASH + 1].fill_(0)
                self._logical_from = logical

    def prepare(self) -> None:
        """Write addresses and attention inputs from the buffers: device work only."""
        torch.add(self.start, self.new, out=self.end)
        self.write = self.pool.write_addresses(self.meta)
        if self.block_mask is None:
            self.read, self.mask = attention_inputs(self.pool, self.meta)
            return
        for buf, value in zip(self.blocks, block_tensors(self.pool, self.table, self.start,
                                                         self.end, 1), strict=True):
            buf.copy_(value)


class StaticStep:
    """A decode step of `model` (a transformers text model taking `inputs_embeds`, M-RoPE
    `position_ids` (3, B, q) and its cache under `cache_keyword`) for `batch` rows.

    `load` copies a planned step's rows in, `run` computes every row's next hidden state into
    `hidden` (B, H): a graph of `run` replays on whatever the buffers hold.
    """

    def __init__(self, model, cache_keyword: str, pool: PagedKV, batch: int, hidden_size: int,
                 dtype: torch.dtype) -> None:
        device = pool.device
        self.model, self.cache_keyword, self.batch = model, cache_keyword, batch
        self.embeds = torch.zeros(batch, 1, hidden_size, device=device, dtype=dtype)
        self.positions = torch.zeros(3, batch, 1, dtype=torch.long, device=device)
        self.kv = StaticKV(pool, batch)
        self.hidden = torch.zeros(batch, hidden_size, device=device, dtype=dtype)

    def load(self, embeds: torch.Tensor, positions: torch.Tensor, meta: Meta) -> None:
        """`embeds` (n, 1, H) and `positions` (3, n, 1) on the device, `meta` the pool's plan
        of the same n rows."""
        rows = embeds.shape[0]
        self.embeds[:rows].copy_(embeds)
        self.positions[:, :rows].copy_(positions)
        self.positions[:, rows:].zero_()
        self.kv.load(meta, rows)

    def run(self) -> None:
        self.kv.prepare()
        out = self.model(inputs_embeds=self.embeds, attention_mask=self.kv.mask,
                         position_ids=self.positions, use_cache=True,
                         **{self.cache_keyword: self.kv})
        self.hidden.copy_(out.last_hidden_state[:, -1])
