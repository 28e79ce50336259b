"""Admission by KV memory on the tiny Qwen3-Omni with pools of a few blocks: a reply without room
fails with server_full, a session past its share is cut by its own truncation policy (or, with
truncation disabled, fails with context_length_exceeded) instead of taking blocks another needs,
and nothing ever raises an out-of-memory error."""

from __future__ import annotations

import pytest

from models.base import TextTurn
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.memory import THINKER
from models.qwen3_omni.tiny import load_preprocessor
from models.reply import ReplySpec, Truncation

OPTIONS = Qwen3OmniOptions(min_text_tokens=2, max_text_tokens=8, min_frames=2, max_frames=6,
                           max_context=256, talker_context=10)
THINKER_POSITION, TALKER_POSITION = 768, 256
"""Bytes of one position of the tiny model's Thinker and Talker KV (float32)."""
TWO_SESSIONS = 2 * (256 * THINKER_POSITION + 64 * TALKER_POSITION)
"""A budget of two sessions at full context: 8 Thinker blocks and 2 Talker blocks (of 64
positions; a reply takes 10 + 16 + 6 at most, in one)."""
AUTO, DISABLED = Truncation("auto"), Truncation("disabled")


@pytest.fixture(scope="module")
def make(tiny_omni_dir):
    loaded = Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)
    prep = load_preprocessor(tiny_omni_dir, loaded.model.config)

    def build() -> Qwen3OmniAdapter:
        ad = Qwen3OmniAdapter(loaded.model, loaded.tokenizer, prep, options=OPTIONS,
                              kv_memory=TWO_SESSIONS)
        assert (ad._pools.thinker.blocks_total, ad._pools.talker.blocks_total) == (8, 2)
        return ad

    return build


def reply(ad, st, truncation=AUTO, audio=False) -> tuple[str | None, dict | None]:
    """A greedy reply to what the session said: its finish reason and usage."""
    ad.begin_response(st, ReplySpec(audio=audio, temperature=0.0, truncation=truncation))
    reason = usage = None
    for _ in range(OPTIONS.max_text_tokens + 2):
        [tok] = ad.thinker_decode([st])
        reason, usage = reason or tok.reason, usage or tok.usage
        if tok.finished:
            break
    ad.reset_response(st)
    return reason, usage


def say(ad, st, text: str) -> None:
    ad.thinker_prefill([st], [TextTurn(text)])


def length(ad, st) -> int:
    return ad._pools.thinker.length[ad._session(st).thinker_slot]


def test_a_newcomer_gets_room_cut_from_sessions_past_their_share(make):
    ad = make()
    a, b = ad.new_state("a"), ad.new_state("b")
    for st in (a, b):
        say(ad, st, "x" * 190)
    assert ad._pools.thinker.available == 0
    assert ad.kv_stats()[THINKER].sessions_admissible == 0
    # A third session's share is 2 of the 8 blocks: a and b, at 4, are past theirs.
    c = ad.new_state("c")
    say(ad, c, "hello there")
    assert length(ad, c) > 0
    assert length(ad, a) < 128 <= length(ad, b)
    reason, usage = reply(ad, c)
    assert reason is None and usage["input_tokens"] == length(ad, c) - OPTIONS.max_text_tokens + 1
    # a was cut by its own (auto) policy, and its next reply says so.
    reason, usage = reply(ad, a)
    assert reason is None and usage["truncated_tokens"] > 60
    for st in (a, b, c):
        ad.free(st)
    assert ad._pools.thinker.blocks_used == 0 and ad._pools.thinker.reserved == {}


def test_with_truncation_disabled_a_full_pool_refuses_and_says_why(make):
    ad = make()
    a, b = ad.new_state("a"), ad.new_state("b")
    for st in (a, b):
        say(ad, st, "x" * 190)
        assert reply(ad, st, DISABLED)[0] is None
    c = ad.new_state("c")
    # No session may be cut for c's input: refused, and c's reply fails for want of memory.
    say(ad, c, "hello there")
    assert length(ad, c) == 0
    assert reply(ad, c)[0] == "server_full"
    # a, past its new share, may not take more: its own input is refused, as past max_context.
    say(ad, a, "and one more thing")
    assert reply(ad, a, DISABLED)[0] == "context_length_exceeded"
    # Once b leaves there is room again.
    ad.free(b)
    say(ad, c, "hello again")
    assert reply(ad, c)[0] is None
    # A new session needs 2 blocks (its reply and a copy): 3 are free beside a's 4 and c's 1.
    stats = ad.kv_stats()[THINKER]
    assert (stats.blocks_used, stats.blocks_free, stats.sessions_admissible) == (5, 3, 1)
    ad.free(a)
    assert ad.kv_stats()[THINKER].sessions_admissible == 3
    ad.free(c)


def test_two_voiced_replies_at_a_time_when_the_talker_pool_holds_two(make):
    ad = make()
    states = [ad.new_state(sid) for sid in "abc"]
    for st in states:
        say(ad, st, "hi")
        ad.begin_response(st, ReplySpec(temperature=0.0))
    tokens = ad.thinker_decode(states)
    assert [t.reason for t in tokens] == [None, None, "server_full"]
    frames = ad.talker_step(states[:2], tokens[:2])
    assert all(f.codes is not None for f in frames)
    ad.reset_response(states[0])
    # b's reply took the block reserved for it; a's came back with its cancel.
    assert ad._pools.talker.blocks_used == 1 and ad._pools.talker.reserved == {}
    assert reply(ad, states[2], audio=True)[0] is None
    for st in states:
        ad.free(st)
    assert ad._pools.talker.blocks_used == 0 and ad._pools.talker.reserved == {}


def test_rows_of_one_forward_never_take_more_blocks_than_there_are(make):
    ad = make()
    a = ad.new_state("a")
    say(ad, a, "x" * 190)
    b, c, d = (ad.new_state(sid) for sid in "bcd")
    say(ad, d, "hi")
    # 3 blocks are free and b and c want 2 each in one forward: c's room is cut from a, past
    # its share of 2 blocks now, rather than taken from b or found missing.
    assert ad._pools.thinker.available == 3
    ad.thinker_prefill([b, c], [TextTurn("y" * 100), TextTurn("z" * 100)])
    assert length(ad, b) == length(ad, c) > 100
    assert length(ad, a) <= 128 and ad._session(a).dropped > 0
    assert ad._pools.thinker.reserved == {}
    for st in (a, b, c, d):
        ad.free(st)
