"""A one-hour call in accelerated time: the tiny Qwen3-Omni driven directly, stage by stage, with
an hour of user audio (20 s turns, each answered) and no wall clock. Under every `truncation`
policy but `disabled` the bytes and KV blocks it holds stay bounded and every turn is answered;
`disabled` refuses what does not fit and says so in the reply's finish reason."""

import numpy as np
import pytest
import torch

from models.base import ModelState
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.reply import ReplySpec, Truncation

pytestmark = pytest.mark.cpu_bound

TURN_S = 30
OPTIONS = Qwen3OmniOptions(max_context=1024, max_text_tokens=2, system_prompt="be brief")


@pytest.fixture(scope="module")
def adapter(tiny_omni_dir):
    # One thread: on a loaded machine torch's thread pool spends most of a small forward
    # waiting for its other threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def second(adapter):
    """One second of speech-like noise, encoded once: the hour repeats its features, so the
    test spends its time in the Thinker, where the context fills, not in the audio encoder."""
    pcm = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    st = adapter.new_state("encoder")
    [features] = adapter.encode_audio([st], [pcm])
    adapter.free(st)
    return features


def turn(adapter, st: ModelState, second, truncation: Truncation):
    """TURN_S seconds of the user, then a reply (text only, greedy); its tokens and the
    reply's usage."""
    audio = type(second)(torch.cat([second.embeds] * TURN_S))
    adapter.thinker_prefill([st], [audio])
    adapter.begin_response(st, ReplySpec(audio=False, temperature=0.0, truncation=truncation))
    tokens, usage, reason = [], None, None
    while True:
        [tok] = adapter.thinker_decode([st])
        usage = usage or tok.usage
        reason = reason or tok.reason
        if tok.token_id is not None:
            tokens.append(tok.token_id)
        if tok.finished:
            break
    adapter.reset_response(st)
    return tokens, usage, reason


@pytest.mark.parametrize(("truncation", "seconds"), [
    (Truncation("auto"), 3600), (Truncation("retention_ratio", 0.5), 900)],
    ids=["auto-hour", "retention_ratio-quarter-hour"])
def test_a_long_call_keeps_bounded_bytes_and_keeps_answering(adapter, second, truncation,
                                                             seconds):
    st = adapter.new_state(f"long-{truncation.type}")
    limit, held, dropped, turns = OPTIONS.max_context, [], 0, seconds // TURN_S
    pool, blocks = adapter._pools.thinker, []
    for _ in range(turns):
        tokens, usage, reason = turn(adapter, st, second, truncation)
        assert tokens and reason is None
        assert usage["input_tokens"] <= limit and usage["truncation"] == truncation.type
        dropped += usage["truncated_tokens"]
        held.append(adapter.bytes_held(st))
        blocks.append(pool.blocks_used)
    sess = adapter._session(st)
    # 13 positions per second of audio: the call went through a context that holds a small
    # part of it.
    assert sess.next_pos > 13 * seconds > 10 * limit
    assert dropped > 13 * seconds - limit
    # Bounded: once the context first filled the bytes and KV blocks held never grew again,
    # and the blocks are those of a full context, a block more at most (a partly filled one).
    assert max(held) == max(held[:10])
    assert max(blocks) == max(blocks[:10]) <= pool.blocks_for(limit) + 1
    if truncation.type == "retention_ratio":
        # Each truncation leaves half the post-instruction room in use, then the new turn.
        length = adapter._pools.thinker.length[sess.thinker_slot]
        assert length <= sess.keep + (limit - sess.keep) // 2 + 20 * TURN_S
    adapter.free(st)
    assert adapter.bytes_held(st) == 0


def test_with_truncation_disabled_a_full_context_refuses_input_and_the_reply_says_why(
        adapter, second):
    st = adapter.new_state("disabled")
    off = Truncation("disabled")
    reasons = [turn(adapter, st, second, off)[2] for _ in range(6)]
    # The first turns fit; once one does not, it is refused and every reply says so.
    first_full = reasons.index("context_length_exceeded")
    assert 0 < first_full and set(reasons[first_full:]) == {"context_length_exceeded"}
    sess = adapter._session(st)
    assert adapter._pools.thinker.length[sess.thinker_slot] <= OPTIONS.max_context
    # The policy travels with each reply: a switch to auto answers from the context as it is
    # (the turn before it was refused under the old policy), and truncates from then on.
    tokens, usage, reason = turn(adapter, st, second, Truncation("auto"))
    assert tokens and reason is None and usage["truncated_tokens"] == 0
    tokens, usage, reason = turn(adapter, st, second, Truncation("auto"))
    assert tokens and reason is None and usage["truncated_tokens"] > 0
    adapter.free(st)
