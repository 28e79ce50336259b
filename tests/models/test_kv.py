"""The KV layouts: sliding windows per session (Moshi), and the paged pool (Qwen3-Omni): blocks
of one pool, a block table per slot, attention reading them in place (FlexAttention) or through
a gather, both checked against attention over each session's own keys, and so is a decode step
from the fixed buffers a CUDA graph holds."""

import numpy as np
import pytest
import torch

from models.kv import KVBatch, SlidingKV, SlotOwnershipError
from models.paged_attention import Q_BLOCK, attention
from models.paged_kv import TRASH, KVExhausted, PagedKV
from models.paged_static import StaticKV


def test_sliding_kv_masks_padding_and_window():
    generator = torch.Generator().manual_seed(4)
    kvs = [SlidingKV(1, 1, 4, window=3) for _ in range(2)]
    history = [[], []]
    for step in range(30):
        sessions = [0] if step < 2 else [0, 1]
        chosen = [kvs[i] for i in sessions]
        batch = KVBatch(chosen, 1)
        q, k, v = (torch.randn(len(sessions), 1, 1, 4, generator=generator) for _ in range(3))
        out = batch.attend(0, q, k, v, scale=0.5)
        batch.commit()
        for row, i in enumerate(sessions):
            history[i].append((k[row], v[row]))
            keys = torch.cat([key for key, _ in history[i][-3:]], dim=1)
            values = torch.cat([value for _, value in history[i][-3:]], dim=1)
            expected = torch.softmax(q[row] @ keys.transpose(1, 2) * 0.5, -1) @ values
            assert torch.allclose(out[row], expected, atol=1e-6), (step, i)
        assert batch.position_ids[:, 0].tolist() == [len(history[i]) - 1 for i in sessions]
    assert all(kv.capacity < 30 for kv in kvs)


LAYERS, HEADS, QUERY_HEADS, DIM, BLOCK = 2, 2, 4, 8, 16


def pool(mode: str = "gather", blocks: int = 24) -> PagedKV:
    return PagedKV(LAYERS, HEADS, DIM, "cpu", torch.float32, blocks, max_positions=256,
                   block_size=BLOCK, attention=mode)


class Reference:
    """Each slot's keys and values as plain tensors, and attention over them alone."""

    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def append(self, slot: int, layer: int, k: torch.Tensor, v: torch.Tensor):
        empty = torch.zeros(HEADS, 0, DIM)
        old_k, old_v = self.kv.get((slot, layer), (empty, empty))
        self.kv[slot, layer] = torch.cat([old_k, k], 1), torch.cat([old_v, v], 1)
        return self.kv[slot, layer]

    def evict(self, slot: int, keep: int, drop: int) -> None:
        for layer in range(LAYERS):
            k, v = self.kv[slot, layer]
            self.kv[slot, layer] = (torch.cat([k[:, :keep], k[:, keep + drop :]], 1),
                                    torch.cat([v[:, :keep], v[:, keep + drop :]], 1))

    def forget(self, slot: int) -> None:
        for layer in range(LAYERS):
            self.kv.pop((slot, layer), None)


def step(kv: PagedKV, ref: Reference, slots: list[int], new: list[int], gen) -> float:
    """One forward of every layer over `slots`, each appending `new[b]` positions; the largest
    difference from attention over each slot's own keys."""
    bound = kv.bind(slots, [kv.owner[s] for s in slots], new)
    q, worst = max(new), 0.0
    for layer in range(LAYERS):
        k, v = (torch.randn(len(slots), HEADS, q, DIM, generator=gen) for _ in range(2))
        query = torch.randn(len(slots), QUERY_HEADS, q, DIM, generator=gen)
        out, _ = attention(None, query, *bound.update(k, v, layer), bound.mask, scaling=0.4)
        for b, (slot, n) in enumerate(zip(slots, new, strict=True)):
            keys, values = ref.append(slot, layer, k[b, :, :n], v[b, :, :n])
            end = keys.shape[1]
            causal = torch.arange(end)[None] <= torch.arange(end - n, end)[:, None]
            expected = torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1, :, :n], keys[None], values[None], attn_mask=causal, scale=0.4,
                enable_gqa=True)[0].transpose(0, 1)
            worst = max(worst, (out[b, :n] - expected).abs().max().item())
    bound.commit()
    return worst


@pytest.mark.parametrize("mode", ["gather", "flex"])
def test_paged_attention_equals_each_session_alone(mode):
    """Mixed lengths across block edges, batches in any order, a reused slot, a cut context:
    every row attends to its own positions, exactly as alone."""
    kv, ref, gen = pool(mode), Reference(), torch.Generator().manual_seed(0)
    a, b, c = (kv.acquire(name) for name in "abc")
    worst = [step(kv, ref, [a, b], [20, 5], gen), step(kv, ref, [c, a, b], [3, 1, 30], gen),
             step(kv, ref, [b, a], [1, 1], gen)]
    kv.release(a, "a")
    ref.forget(a)
    d = kv.acquire("d")
    assert d == a
    worst.append(step(kv, ref, [d, c], [40, 1], gen))
    kv.evict(b, 3, 17)
    ref.evict(b, 3, 17)
    worst += [step(kv, ref, [b, d, c], [1, 1, 2], gen), step(kv, ref, [c], [1], gen)]
    assert max(worst) < 1e-5
    assert [kv.length[s] for s in (b, c, d)] == [20, 7, 41]
    assert kv.blocks_used == sum(kv.blocks_for(kv.length[s]) for s in (b, c, d))


def static_step(kv: PagedKV, static: StaticKV, ref: Reference, slots: list[int], gen) -> float:
    """One decode step of every layer over `slots` from a bucket's fixed buffers (the rows
    past them padding); the largest difference from attention over each slot's own keys.
    Padding reads numbers and writes nowhere but the trash block."""
    rows, size = len(slots), static.table.shape[0]
    static.load(kv.plan(slots, [kv.owner[s] for s in slots], [1] * rows), rows)
    written = {int(kv.addresses(s, kv.length[s], kv.length[s] + 1)[0]) for s in slots}
    before = kv.keys.clone()
    static.prepare()
    worst = 0.0
    for layer in range(LAYERS):
        k, v = (torch.randn(size, HEADS, 1, DIM, generator=gen) for _ in range(2))
        query = torch.randn(size, QUERY_HEADS, 1, DIM, generator=gen)
        out, _ = attention(None, query, *static.update(k, v, layer), static.mask, scaling=0.4)
        assert out[rows:].isfinite().all()
        for b, slot in enumerate(slots):
            keys, values = ref.append(slot, layer, k[b], v[b])
            expected = torch.nn.functional.scaled_dot_product_attention(
                query[b : b + 1], keys[None], values[None], scale=0.4,
                enable_gqa=True)[0].transpose(0, 1)
            worst = max(worst, (out[b] - expected).abs().max().item())
    # Bit for bit: the gather's pool is allocated empty, and NaN is not equal to itself.
    bits = kv.keys.view(torch.int32) != before.view(torch.int32)
    changed = set(torch.nonzero(bits.flatten(0, 1).any(0).any(-1)).flatten().tolist())
    trash = set(range(TRASH * BLOCK, (TRASH + 1) * BLOCK))
    assert changed - trash == written
    kv.commit(slots, [1] * rows)
    return worst


@pytest.mark.parametrize("mode", ["gather", "flex"])
def test_a_decode_step_from_fixed_buffers_reads_each_sessions_own_keys(mode):
    """A bucket of four (`models.paged_static`): rows of mixed lengths, one taking a new block;
    fewer rows than before, the rest padding where real rows were; a slot sharing another's
    head, copied before its first write; a context truncated. Every row attends to its own
    positions as alone, and the buffers stay where they were allocated."""
    kv, ref, gen = pool(mode), Reference(), torch.Generator().manual_seed(3)
    a, b, c, d = (kv.acquire(name) for name in "abcd")
    step(kv, ref, [a, b, c, d], [BLOCK, 5, 2 * BLOCK + 3, 1], gen)
    static = StaticKV(kv, 4)
    buffers = [static.table, static.start, static.end, *(static.blocks if mode == "flex" else ())]
    addresses, mask = [t.data_ptr() for t in buffers], static.mask
    worst = [static_step(kv, static, ref, [a, b, c, d], gen),
             static_step(kv, static, ref, [c, b], gen)]
    held = kv.hold(b, 6)
    e = kv.acquire("e")
    kv.share(e, held, 6)
    for layer in range(LAYERS):
        ref.kv[e, layer] = ref.kv[b, layer][0][:, :6], ref.kv[b, layer][1][:, :6]
    shared = kv.keys[:, :, held[0] * BLOCK : (held[0] + 1) * BLOCK].clone()
    worst.append(static_step(kv, static, ref, [e, b, a], gen))
    assert kv.rows[e][0] != held[0]
    # Bit for bit: the block's unwritten tail is uninitialised memory, which may hold NaNs.
    after = kv.keys[:, :, held[0] * BLOCK : (held[0] + 1) * BLOCK]
    assert torch.equal(after.view(torch.int32), shared.view(torch.int32))
    ref.evict(c, BLOCK + 1, kv.length[c] - (BLOCK + 1))
    kv.truncate(c, "c", BLOCK + 1)
    worst += [static_step(kv, static, ref, [c, e], gen), static_step(kv, static, ref, [c], gen)]
    assert max(worst) < 1e-5
    assert [kv.length[s] for s in (a, b, c, d, e)] == [BLOCK + 2, 8, BLOCK + 3, 2, 8]
    assert [t.data_ptr() for t in buffers] == addresses
    if mode == "flex":
        assert static.mask is mask


def test_a_shared_prefix_is_read_in_place_and_copied_before_a_write():
    kv, ref, gen = pool(), Reference(), torch.Generator().manual_seed(1)
    first = kv.acquire("first")
    step(kv, ref, [first], [BLOCK + 5], gen)
    held = kv.hold(first, BLOCK + 5)
    assert len(held) == 2 and all(kv.refs[b] == 2 for b in held)
    second = kv.acquire("second")
    kv.share(second, held, BLOCK + 5)
    for layer in range(LAYERS):
        ref.kv[second, layer] = ref.kv[first, layer]
    used = kv.blocks_used
    # Both write into the shared, partly filled block: each copies it first, the whole first
    # block stays shared, and the copy of record (`held`) is never written.
    before = kv.keys[:, :, held[1] * BLOCK : (held[1] + 1) * BLOCK].clone()
    assert kv.blocks_needed(second, 1) == 1
    assert step(kv, ref, [second, first], [2, 1], gen) < 1e-5
    assert kv.rows[first][0] == kv.rows[second][0] == held[0]
    assert held[1] not in (kv.rows[first][1], kv.rows[second][1])
    assert torch.equal(kv.keys[:, :, held[1] * BLOCK : (held[1] + 1) * BLOCK], before)
    assert kv.blocks_used == used + 2
    kv.release(first, "first")
    kv.release(second, "second")
    assert kv.blocks_used == 2
    kv.drop(held)
    assert kv.blocks_used == 0


def test_slots_check_owners_truncate_and_give_blocks_back():
    kv, ref, gen = pool(blocks=4), Reference(), torch.Generator().manual_seed(2)
    a, b = kv.acquire("a"), kv.acquire("b")
    step(kv, ref, [a, b], [3 * BLOCK - 1, 1], gen)
    assert kv.blocks_used == 4 and kv.slot_bytes(a) == 3 * kv.slot_bytes(b) == 3 * kv.block_bytes
    with pytest.raises(SlotOwnershipError):
        kv.bind([a], ["b"], [1])
    with pytest.raises(SlotOwnershipError):
        kv.release(b, "a")
    with pytest.raises(SlotOwnershipError):
        kv.truncate(a, "b", 1)
    with pytest.raises(KVExhausted):
        kv.bind([b], ["b"], [BLOCK])
    kv.truncate(a, "a", BLOCK + 2)
    assert kv.length[a] == BLOCK + 2 and kv.blocks_used == 3
    assert np.array_equal(kv.addresses(a, 0, BLOCK + 2) // BLOCK,
                          np.repeat(kv.rows[a], [BLOCK, 2]))
    kv.release(a, "a")
    kv.release(b, "b")
    assert kv.blocks_used == 0 and kv.available == 4


def test_reservations_keep_blocks_for_their_owner():
    kv = pool(blocks=4)
    assert kv.reserve("a", 3) and not kv.reserve("b", 2)
    assert kv.available == 1
    b = kv.acquire("b")
    kv.bind([b], ["b"], [BLOCK]).commit()
    assert kv.available == 0 and not kv.reserve("b", 1)
    a = kv.acquire("a")
    kv.bind([a], ["a"], [2 * BLOCK]).commit()
    assert kv.reserved == {"a": 1} and kv.available == 0
    kv.release(a, "a")
    assert kv.reserved == {} and kv.available == 3


def test_the_block_mask_lists_every_block_a_query_reads_and_no_other():
    """What the GPU's kernel visits: for each query block, the blocks `mask_mod` opens at all
    (listed), those it opens entirely as full (no mask inside), and blocks of other rows never.
    Checked against `mask_mod` itself, over every position of the pool."""
    kv = pool("flex", blocks=40)
    a, b, c = (kv.acquire(name) for name in "abc")
    kv.bind([a, b], ["a", "b"], [5, 2 * BLOCK + 3]).commit()
    for new in ([1, 1, Q_BLOCK + 40], [1, 2, 1]):
        bound = kv.bind([a, b, c], ["a", "b", "c"], new)
        mask = bound.mask
        q, positions = max(new), kv.keys.shape[2]
        n_q = -(-q // Q_BLOCK)
        for row in range(3):
            q_idx = torch.arange(q)[:, None]
            kv_idx = torch.arange(positions)[None]
            opens = mask.mask_mod(torch.tensor(row), torch.tensor(0), q_idx, kv_idx)
            for qb in range(n_q):
                # (queries of the block, pool blocks, positions of a block)
                block_rows = opens[qb * Q_BLOCK : (qb + 1) * Q_BLOCK].view(-1, kv.blocks_total + 1,
                                                                            BLOCK)
                any_open, all_open = block_rows.any(2).any(0), block_rows.all(2).all(0)
                n_partial = mask.kv_num_blocks[row, 0, qb]
                n_full = mask.full_kv_num_blocks[row, 0, qb]
                partial = set(mask.kv_indices[row, 0, qb, :n_partial].tolist())
                full = set(mask.full_kv_indices[row, 0, qb, :n_full].tolist())
                assert not partial & full
                assert set(torch.nonzero(any_open).flatten().tolist()) <= partial | full
                assert all(all_open[block] for block in full)
                assert partial | full <= set(kv.rows[[a, b, c][row]])
        bound.commit()
