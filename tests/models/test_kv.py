"""The KV pools both families share: sliding windows per session, slots in one buffer."""

import pytest
import torch

from models.kv import KVBatch, SlidingKV, SlotKV, SlotOwnershipError


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


def test_slot_kv_checks_owners_and_gives_memory_back():
    pool = SlotKV(2, 1, 4, "cpu", torch.float32)
    a, b = pool.acquire("a"), pool.acquire("b")
    bound = pool.bind([a, b], ["a", "b"], [3, 1])
    for layer in range(2):
        bound.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4), layer)
    bound.commit()
    assert pool.length[a] == 3 and pool.length[b] == 1
    assert pool.nbytes == 2 * pool.slot_bytes() > 0
    with pytest.raises(SlotOwnershipError):
        pool.bind([a], ["b"], [1])
    with pytest.raises(SlotOwnershipError):
        pool.release(b, "a")
    pool.release(a, "a")
    assert pool.acquire("c") == a and pool.length[a] == 0
    pool.release(a, "c")
    pool.release(b, "b")
    assert pool.nbytes == 0 and pool.capacity == 0
