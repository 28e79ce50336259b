"""The Thinker's context as a conversation a client edits: every kind of item laid as its own
turn, marks at item boundaries, rewinds that bring the context back to one and lay it again
from there, exactly as a context laid in one go."""

from __future__ import annotations

import json

import pytest

from models.base import Mark, Rewind, TextTurn
from models.echo import EchoModel
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.context import call_text
from models.reply import ReplySpec

OPTIONS = Qwen3OmniOptions(min_text_tokens=6, max_text_tokens=6, min_frames=4, max_frames=4)
A = [Mark(0), TextTurn("hello there")]
X = [Mark(1), TextTurn("You are a pirate.", "system")]
B = [Mark(2), TextTurn("what is the weather like")]


@pytest.fixture(scope="module")
def adapter(tiny_omni_dir):
    return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)


def lay(ad, st, features) -> None:
    for feature in features:
        ad.thinker_prefill([st], [feature])


def reply(ad, st) -> list[int]:
    ad.begin_response(st, ReplySpec(temperature=0.0, audio=False))
    tokens = []
    while True:
        [tok] = ad.thinker_decode([st])
        tokens.append(ad._session(st).last_token)
        if tok.finished:
            return tokens


def fresh(ad, sid: str, features) -> list[int]:
    st = ad.new_state(sid)
    lay(ad, st, features)
    out = reply(ad, st)
    ad.free(st)
    return out


def test_a_rewind_past_an_item_replies_as_the_context_without_it(adapter):
    st = adapter.new_state("edited")
    lay(adapter, st, A + X + B)
    held = adapter._pools.thinker.length[adapter._session(st).thinker_slot]
    lay(adapter, st, [Rewind(1)])
    kept = adapter._pools.thinker.length[adapter._session(st).thinker_slot]
    assert 0 < kept < held  # the prefix before the mark keeps its KV
    lay(adapter, st, B)
    edited = reply(adapter, st)
    assert edited == fresh(adapter, "a-b", A + B)
    assert edited != fresh(adapter, "a-x-b", A + X + B)
    # After a reply too: the same turn laid again gives the same reply.
    lay(adapter, st, [Mark(3), TextTurn("and tomorrow?")])
    first = reply(adapter, st)
    lay(adapter, st, [Rewind(3), Mark(3), TextTurn("and tomorrow?")])
    assert reply(adapter, st) == first
    adapter.free(st)


def test_system_assistant_and_call_turns_each_change_the_reply(adapter):
    base = fresh(adapter, "base", A + B)
    call = json.dumps({"name": "get_weather", "arguments": '{"city": "Paris"}'})
    for turn in (TextTurn("Sure, one moment.", "assistant"), TextTurn(call, "function_call"),
                 TextTurn("Answer in French.", "system")):
        assert fresh(adapter, turn.role, A + [Mark(1), turn] + B) != base, turn.role


def test_a_call_is_written_as_the_model_writes_its_own():
    text = call_text(json.dumps({"name": "get_weather", "arguments": '{"city": "Paris"}'}))
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert '"arguments": {}' in call_text(json.dumps({"name": "now", "arguments": ""}))


def test_a_rewind_to_an_unknown_mark_is_refused(adapter):
    st = adapter.new_state("unknown")
    lay(adapter, st, A)
    with pytest.raises(ValueError, match="no mark 7"):
        lay(adapter, st, [Rewind(7)])
    adapter.free(st)


def test_echo_repeats_only_what_the_user_said():
    echo = EchoModel()
    st = echo.new_state("e")
    echo.thinker_prefill([st], [TextTurn("Be brief.", "system")])
    echo.thinker_prefill([st], [TextTurn("hi ")])
    echo.thinker_prefill([st], [TextTurn("I am the assistant", "assistant")])
    echo.thinker_prefill([st], [TextTurn("there")])
    echo.begin_response(st)
    words = []
    while True:
        [tok] = echo.thinker_decode([st])
        words.append(tok.text)
        if tok.finished:
            break
    assert "".join(words) == "hi there"
