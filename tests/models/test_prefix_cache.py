"""The Thinker's prefix cache on the tiny Qwen3-Omni: sessions whose context opens with the
same system turn compute it once, reply exactly as if they had computed it themselves, and
never share their own KV."""

from __future__ import annotations

import copy

import pytest
import torch

from models.base import TextTurn
from models.prefix_cache import PrefixCache
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.tiny import load_preprocessor
from models.reply import ReplySpec

OPTIONS = Qwen3OmniOptions(min_text_tokens=8, max_text_tokens=8)
GREEDY = ReplySpec(temperature=0.0)
# The tiny tokenizer is byte-level: a character is a token.
LONG_PROMPT = ("You are the help desk of a railway. " * 60)[:2000]
PROMPT = LONG_PROMPT[:300]


@pytest.fixture(scope="module")
def loaded(tiny_omni_dir):
    return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)


@pytest.fixture(scope="module")
def make(tiny_omni_dir, loaded):
    """Adapters on the loaded weights (or `model`), each with the prefix cache it is given."""
    prep = load_preprocessor(tiny_omni_dir, loaded.model.config)

    def build(cache: PrefixCache, model=None) -> Qwen3OmniAdapter:
        return Qwen3OmniAdapter(model or loaded.model, loaded.tokenizer, prep, options=OPTIONS,
                                prefix_cache=cache)

    return build


def reply(ad: Qwen3OmniAdapter, sids: list[str], prompts: list[str], free: bool = True):
    """Greedy replies of sessions that open with `prompts` and are asked the same thing, all
    in one batch; (their token ids, Thinker positions computed, the states)."""
    states = [ad.new_state(sid) for sid in sids]
    for st, prompt in zip(states, prompts, strict=True):
        ad.instruct(st, prompt, ())
    before = ad._thinker.positions
    ad.thinker_prefill(states, [TextTurn("when is the next train")] * len(states))
    for st in states:
        ad.begin_response(st, GREEDY)
    tokens = [[] for _ in states]
    while not all(ad._session(st).thinker_done for st in states):
        ad.thinker_decode(states)
        for row, st in zip(tokens, states, strict=True):
            sess = ad._session(st)
            if len(row) < len(sess.token_ids):
                row.append(sess.last_token)
    computed = ad._thinker.positions - before
    if free:
        for st in states:
            ad.free(st)
    return tokens, computed, states


def head_length(ad: Qwen3OmniAdapter, prompt: str) -> int:
    st = ad.new_state("probe")
    ad.instruct(st, prompt, ())
    keep = ad._session(st).keep
    ad.free(st)
    return keep


def test_a_shared_prefix_replies_as_an_unshared_prefill_and_costs_no_prefill(make):
    unshared, shared = make(PrefixCache(0)), make(PrefixCache(64 << 20))
    [expected], full, _ = reply(unshared, ["u"], [LONG_PROMPT])
    [first], first_cost, _ = reply(shared, ["a"], [LONG_PROMPT])
    [second], second_cost, _ = reply(shared, ["b"], [LONG_PROMPT])
    keep = head_length(shared, LONG_PROMPT)
    assert keep > 2000 and len(expected) == 8
    assert first == expected and second == expected
    assert first_cost == full
    # The second session computes its own turn and reply, not one position of the prompt.
    assert second_cost == full - keep
    stats = shared.prefix_cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (1, 1, 1)
    assert unshared.prefix_cache.stats().entries == 0


def test_cached_tokens_are_those_served_from_the_prefix_cache(make):
    ad = make(PrefixCache(64 << 20))
    keep = head_length(ad, PROMPT)

    def cached(sid: str) -> int:
        st = ad.new_state(sid)
        ad.instruct(st, PROMPT, ())
        ad.thinker_prefill([st], [TextTurn("when is the next train")])
        ad.begin_response(st, GREEDY)
        usage = ad.thinker_decode([st])[0].usage
        ad.free(st)
        return usage["cached_tokens"]

    # The first session computes its head (nothing was served), the next takes it.
    assert [cached("first"), cached("second")] == [0, keep]


def test_sessions_in_one_batch_with_alike_and_other_prompts(make):
    other = "Speak like a station announcer."
    prompts = [PROMPT, other, PROMPT]
    expected, full, _ = reply(make(PrefixCache(0)), ["u1", "u2", "u3"], prompts)
    ad = make(PrefixCache(64 << 20))
    first, first_cost, _ = reply(ad, ["a1", "a2", "a3"], prompts)
    again, again_cost, states = reply(ad, ["b1", "b2", "b3"], prompts, free=False)
    assert first == expected and again == expected
    # Opening together, the two alike sessions compute their common head once.
    assert first_cost == full - head_length(ad, PROMPT)
    assert again_cost == full - sum(head_length(ad, p) for p in prompts)
    stats = ad.prefix_cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (4, 2, 2)
    # Each live session pins the entry its context opened with.
    keys = {ad._session(st).prefix for st in states}
    assert len(keys) == 2 and sorted(ad.prefix_cache.refs(k) for k in keys) == [1, 2]
    for st in states:
        ad.free(st)
    assert [ad.prefix_cache.refs(k) for k in keys] == [0, 0]


def entry_keys(cached) -> torch.Tensor:
    """The keys of every layer at a cache entry's positions, as its pool holds them now."""
    pool = cached.pool
    at = torch.cat([torch.arange(b * pool.block_size, (b + 1) * pool.block_size)
                    for b in cached.blocks])[: cached.length]
    return pool.keys[:, :, at].clone()


def test_eviction_frees_bytes_and_an_entry_in_use_is_kept(make):
    first, second = "A" * 600, "B" * 600
    probe = make(PrefixCache(0))
    kv = probe._pools.thinker
    entry_bytes = kv.blocks_for(head_length(probe, first)) * kv.block_bytes
    ad = make(PrefixCache(entry_bytes))
    cache, pool = ad.prefix_cache, ad._pools.thinker
    expected_second, _, _ = reply(probe, ["p"], [second])

    _, _, [holder] = reply(ad, ["holder"], [first], free=False)
    held_key = ad._session(holder).prefix
    cached = cache.take(held_key)
    cache.release(held_key)
    snapshot = entry_keys(cached)
    # The holder wrote past its head into the head's last block: it copied that block first.
    holder_row = pool.rows[ad._session(holder).thinker_slot]
    assert holder_row[: len(cached.blocks) - 1] == list(cached.blocks[:-1])
    assert holder_row[len(cached.blocks) - 1] != cached.blocks[-1]
    # No room for a second entry while the first is in use: it is not evicted, the newcomer
    # is not kept, and still replies as it should.
    got, _, _ = reply(ad, ["newcomer"], [second])
    assert got == expected_second
    stats = cache.stats()
    assert (stats.refused, stats.evictions, stats.entries, stats.bytes) == (1, 0, 1, entry_bytes)
    assert torch.equal(entry_keys(cached), snapshot)

    ad.free(holder)
    assert ad.bytes_held(holder) == 0 and cache.stats().bytes == entry_bytes
    # The entry alone holds its blocks now, and gives them back to the pool when evicted.
    assert all(pool.refs[b] == 1 for b in cached.blocks)
    used = pool.blocks_used
    reply(ad, ["later"], [second])
    stats = cache.stats()
    assert (stats.evictions, stats.entries, stats.bytes) == (1, 1, entry_bytes)
    assert held_key not in cache
    assert pool.blocks_used == used - len(cached.blocks) + kv.blocks_for(head_length(ad, second))


def test_another_model_version_never_gets_this_ones_prefix(make, loaded):
    cache = PrefixCache(64 << 20)
    changed = copy.deepcopy(loaded.model)
    # Other values (a retrained checkpoint's), strong enough that a reply over the first
    # model's prefix KV would differ from this model's own.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in changed.thinker.model.language_model.layers:
            layer.self_attn.v_proj.weight.normal_(0.0, 0.2, generator=gen)
    reply(make(cache), ["a"], [PROMPT])
    other = make(cache, changed)
    [got], _, _ = reply(other, ["b"], [PROMPT])
    [expected], _, _ = reply(make(PrefixCache(0), changed), ["c"], [PROMPT])
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (0, 2, 2)
    assert got == expected
