"""Attention over a paged KV pool (`models.paged_kv`), as a transformers attention function.

Two ways to read a batch's blocks, chosen per pool:

- "flex" reads them in place: FlexAttention over the whole pool (one (1, kv_heads, positions,
  head_dim) tensor per layer) with a `BlockMask` whose rows list their own blocks, so the kernel
  visits only those; the mask inside a block keeps each query to its row's positions up to its
  own (causal). GQA is the kernel's: keys are never repeated to the query heads. On CUDA it is
  compiled once (`torch.compile`); the default there.
- "gather" copies each row's positions out of the pool, padded to the batch's longest, and runs
  scaled_dot_product_attention under a boolean mask with GQA on. The default on the CPU:
  compiled FlexAttention recompiles for each new batch size and length (seconds each on two
  cores) and uncompiled it scores every query against the whole pool, while a gather on the CPU
  is a memory copy beside a forward that costs far more. The tests run both and compare.

The attention function is registered with transformers under `NAME` and set on the Thinker's and
Talker's text configs; a call that does not come through a `BoundKV` (a `DynamicCache`,
`generate`) gets transformers' own SDPA path, with its own masks.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

log = logging.getLogger("duplex.models")

NAME = "duplex_paged"
Q_BLOCK = 128
"""Query positions per block of a BlockMask (a decode step is one)."""


def attention(module, query, key, value, attention_mask, dropout: float = 0.0,
              scaling: float | None = None, **kwargs):
    """transformers' attention signature -> ((B, q, heads, head_dim), None)."""
    if isinstance(attention_mask, BlockMask):
        cuda = query.device.type == "cuda"
        # The kernel's KV tile must divide a block (a sparse block of the mask).
        options = {"BLOCK_N": attention_mask.BLOCK_SIZE[1]} if cuda else None
        out = _flex(query.device)(query, key, value, block_mask=attention_mask, scale=scaling,
                                  enable_gqa=query.shape[1] != key.shape[1],
                                  kernel_options=options)
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        # The gather's mask, or transformers' own: either way SDPA's GQA, not repeat_kv.
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])

_compiled = None


def _flex(device: torch.device):
    """FlexAttention, compiled on CUDA (its fused kernel); eager elsewhere."""
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        # Batch sizes and query lengths vary from call to call: dynamo makes them dynamic after
        # the first recompile; the limit only guards against an unforeseen shape churning.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled = torch.compile(flex_attention, fullgraph=True)
    return _compiled


def use_paged_attention(text_config) -> None:
    """Make a text model's attention layers call `attention` (this module's)."""
    text_config._attn_implementation = NAME


def attention_inputs(pool, meta) -> tuple[torch.Tensor | None, torch.Tensor | BlockMask]:
    """(read addresses (B, kv_len) for the gather or None, the attention mask) of a bound
    forward; every tensor derived on the device from the bound rows. The gather's mask is
    (B, 1, q, kv_len) bool, True where a query may attend; transformers passes a 4D mask (and
    a BlockMask) to the attention function as it is."""
    if pool.attention == "flex":
        return None, block_mask(pool, meta)
    bs, device = pool.block_size, pool.device
    j = torch.arange(meta.kv_len, device=device)
    kv_end = meta.start + meta.new
    valid = j[None] < kv_end[:, None]
    block = meta.table.index_select(1, torch.div(j, bs, rounding_mode="floor"))
    read = torch.where(valid, block * bs + j % bs, pool._trash[j % bs])
    t = torch.arange(meta.q, device=device)
    causal = j[None, None] <= (meta.start[:, None] + t)[:, :, None]
    return read, (valid[:, None] & causal)[:, None]


def block_mask(pool, meta) -> BlockMask:
    """The BlockMask of a forward over the pool: query block i of row b visits the blocks of
    its row that hold a position before its last query (or the row's end), those entirely
    before its first query as full blocks (no mask inside), the rest under `mask_mod`."""
    kv_end = meta.start + meta.new
    return make_block_mask(pool, meta.q, block_tensors(pool, meta.table, meta.start, kv_end,
                                                       meta.q),
                           paged_mask_mod(pool, pool.logical_index(), meta.table, meta.start,
                                          kv_end))


def block_tensors(pool, table: torch.Tensor, start: torch.Tensor, kv_end: torch.Tensor,
                  q: int) -> tuple[torch.Tensor, ...]:
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of rows whose block
    tables are `table` (B, max_blocks), holding `start` positions before this forward and
    `kv_end` after it, `q` queries each: device ops on fixed shapes only (the shapes depend
    on B and q, never on a row's length), so a CUDA graph can hold them."""
    bs, device, width = pool.block_size, pool.device, pool.max_blocks
    n_q = -(-q // Q_BLOCK)
    first = start[:, None] + torch.arange(n_q, device=device) * Q_BLOCK
    reach = torch.minimum(first + Q_BLOCK, kv_end[:, None])
    total = -(-reach // bs)
    full = torch.minimum(torch.minimum((first + 1) // bs, kv_end[:, None] // bs), total)
    cols = torch.arange(width, device=device)
    whole = table[:, None].expand(-1, n_q, -1)
    partial = table.gather(1, (full[:, :, None] + cols).clamp(max=width - 1).flatten(1))
    partial = partial.view(-1, n_q, width)
    return ((total - full)[:, None].to(torch.int32), partial[:, None].to(torch.int32),
            full[:, None].to(torch.int32), whole[:, None].to(torch.int32))


def paged_mask_mod(pool, logical: torch.Tensor, rows: torch.Tensor, start: torch.Tensor,
                   kv_end: torch.Tensor):
    """The mask inside the blocks a row visits: its own positions, up to its query's (causal)
    and its end. `logical` says each block's index in the slots that hold it."""
    bs, width = pool.block_size, pool.max_blocks

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // bs
        index = logical[block]
        # The row's own block at that index: another row's block (or a free one) is never read.
        own = (index >= 0) & (rows[b, index.clamp(0, width - 1)] == block)
        pos = index * bs + kv_idx % bs
        return own & (pos < kv_end[b]) & (pos <= start[b] + q_idx)

    return mask_mod


def make_block_mask(pool, q: int, tensors: tuple[torch.Tensor, ...], mask_mod) -> BlockMask:
    """A BlockMask over the whole pool from `block_tensors` (no device work: it only holds
    them, so one made over fixed buffers serves every forward that refills them)."""
    return BlockMask.from_kv_blocks(*tensors, BLOCK_SIZE=(Q_BLOCK, pool.block_size),
                                    mask_mod=mask_mod, seq_lengths=(q, pool.keys.shape[2]),
                                    compute_q_blocks=False)


def flex_works(pool) -> bool:
    """Whether FlexAttention runs on `pool`'s device and agrees with the gather, checked on
    two rows (a decode step and a prefill across a block edge) before any session uses the
    pool; the check compiles the kernel. False, logged, sends the pool to the gather."""
    generator = torch.Generator(device=pool.device).manual_seed(0)
    heads, dim = pool.keys.shape[1], pool.keys.shape[3]
    slots = [pool.acquire("~flex-check-a"), pool.acquire("~flex-check-b")]
    owners = [pool.owner[s] for s in slots]
    try:
        for new in ([pool.block_size + 3, 5], [1, 1]):
            bound = pool.bind(slots, owners, new)
            batch, q = len(slots), max(new)
            key, value = (torch.randn(batch, heads, q, dim, generator=generator,
                                      device=pool.device, dtype=pool.dtype) for _ in range(2))
            query = torch.randn(batch, 2 * heads, q, dim, generator=generator,
                                device=pool.device, dtype=pool.dtype)
            paged = attention(None, query, *bound.update(key, value, 0), bound.mask)[0]
            pool.attention = "gather"
            read, mask = attention_inputs(pool, bound.meta)
            pool.attention = "flex"
            gathered = attention(None, query, pool.keys[0][:, read].transpose(0, 1),
                                 pool.values[0][:, read].transpose(0, 1), mask)[0]
            for b, n in enumerate(new):
                torch.testing.assert_close(paged[b, :n], gathered[b, :n], atol=2e-2, rtol=2e-2)
            bound.commit()
    except Exception:
        log.exception("FlexAttention failed its check on %s; the KV pool gathers instead",
                      pool.device)
        return False
    finally:
        for slot, owner in zip(slots, owners, strict=True):
            pool.release(slot, owner)
    return True
