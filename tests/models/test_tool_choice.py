"""`tool_choice` "required" and a named function make the Qwen3-Omni reply a call (constrained
decoding, per row of the batch); "auto" replies as it did. The reply's text is read by the
engine's own Thinker-output parser, as a served reply is."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.engine.thinker_text import CallDone, Speech, ThinkerText
from models.base import TextTurn
from models.echo import EchoModel
from models.qwen3_omni.adapter import Qwen3OmniAdapter
from models.reply import ReplySpec
from models.tool_forcing import CallForcing, forced_names

TOOLS = tuple({"type": "function", "name": name, "parameters": {"type": "object"}}
              for name in ("get_weather", "get_time"))
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def adapter(tiny_omni_dir):
    return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir)


def replies(ad: Qwen3OmniAdapter, specs: list[ReplySpec],
            sids: list[str] | None = None) -> list[list[int]]:
    """Each spec's reply token ids to the same user text, the rows decoded in one batch."""
    states = [ad.new_state(sid) for sid in sids or [f"s{i}" for i in range(len(specs))]]
    ad.thinker_prefill(states, [TextTurn("what is the weather like")] * len(states))
    for state, spec in zip(states, specs, strict=True):
        ad.begin_response(state, spec)
    tokens: list[list[int]] = [[] for _ in states]
    live = list(range(len(states)))
    while live:
        out = ad.thinker_decode([states[i] for i in live])
        for i, tok in zip(list(live), out, strict=True):
            tokens[i].append(ad._session(states[i]).last_token)
            if tok.finished:
                live.remove(i)
    for state in states:
        ad.free(state)
    return tokens


def parsed(ad: Qwen3OmniAdapter, ids: list[int]) -> list:
    parser = ThinkerText()
    text = ad.tokenizer.decode(ids, skip_special_tokens=True)
    return [p for p in parser.feed(text) + parser.finish() if isinstance(p, (Speech, CallDone))]


def spec(choice, **kw) -> ReplySpec:
    return ReplySpec(**{"temperature": 0.0, **kw}, tools=TOOLS, tool_choice=choice)


def test_a_named_function_makes_the_reply_that_call(adapter):
    [ids] = replies(adapter, [spec(NAMED)])
    [call] = parsed(adapter, ids)
    assert isinstance(call, CallDone) and call.name == "get_weather"
    assert ids[-1] in adapter._thinker.ids["eos"]


def test_required_calls_one_of_the_tools_the_model_choosing_which(adapter):
    [ids] = replies(adapter, [spec("required")])
    [call] = parsed(adapter, ids)
    assert isinstance(call, CallDone) and call.name in ("get_weather", "get_time")
    # The tiny model's own preference among the names: naming the other one overrides it.
    other = {"type": "function", "name": ({"get_weather", "get_time"} - {call.name}).pop()}
    [forced] = parsed(adapter, replies(adapter, [spec(other)])[0])
    assert forced.name == other["name"]


def test_auto_replies_as_without_tool_choice_and_is_no_call(adapter):
    auto, plain = replies(adapter, [spec("auto"), ReplySpec(temperature=0.0, tools=TOOLS)])
    assert auto == plain
    assert not any(isinstance(p, CallDone) for p in parsed(adapter, auto))


@pytest.mark.parametrize("slack", [0, 3])
def test_a_call_closes_within_the_replys_token_limit(adapter, slack):
    """With room for no argument at all the call is `{}`; with a little, what the tiny model
    wrote (random bytes, not JSON: reported raw) is closed in time."""
    limit = adapter._thinker.forcing(NAMED, TOOLS).overhead + slack
    [ids] = replies(adapter, [spec(NAMED, max_output_tokens=limit)])
    assert len(ids) <= limit and ids[-1] in adapter._thinker.ids["eos"]
    [call] = parsed(adapter, ids)
    assert call.name == "get_weather"
    if not slack:
        assert call.valid and json.loads(call.arguments) == {}


def test_rows_with_mixed_tool_choices_decode_each_as_if_alone(adapter):
    specs = [spec("auto"), spec("required"), spec(NAMED),
             spec({"type": "function", "name": "get_time"}, temperature=1.0)]
    alone = [replies(adapter, [s], [f"s{i}"])[0] for i, s in enumerate(specs)]
    assert replies(adapter, specs) == alone
    names = [[p.name for p in parsed(adapter, ids) if isinstance(p, CallDone)] for ids in alone]
    assert names[0] == [] and len(names[1]) == 1
    assert names[2:] == [["get_weather"], ["get_time"]]


def test_only_required_and_a_named_function_force_a_call():
    assert forced_names("auto", TOOLS) == forced_names("none", TOOLS) == ()
    assert forced_names("required", TOOLS) == ("get_weather", "get_time")
    assert forced_names(NAMED, TOOLS) == ("get_weather",)


def _chars(text: str) -> list[int]:
    """A tokenizer of one token per character (ids are code points)."""
    return [ord(c) for c in text]


EOS = -2
FREE = st.lists(st.sampled_from(['{', '}', '[', ']', '"', '\\', ':', ',', 'a', ' ', '}}',
                                 '"}', '}\n</tool_call>', 'x"}}\n', '</tool_call> ok', '[{"']), max_size=30)


@settings(max_examples=300, deadline=None)
@given(FREE, st.integers(0, 60), st.data())
def test_whatever_the_model_writes_the_reply_is_one_call_to_an_allowed_name(free, slack, data):
    """A model that writes any text where it is free, and any allowed token where it is not,
    ends with one call of an allowed name, then the end of turn, within the budget."""
    names = ("get_weather", "get_time")
    forcing = CallForcing(names, _chars, EOS)
    budget = forcing.overhead + slack
    written: list[str] = []
    free = list(free)
    while len(written) < budget:
        allowed = forcing.allowed(budget - len(written))
        if allowed is None:
            text = free.pop(0) if free else "a"
            token = -1
        else:
            token = data.draw(st.sampled_from(sorted(allowed)))
            text = "" if token == EOS else chr(token)
        forcing.advance(token, text)
        written.append(text)
        if token == EOS:
            break
    assert written[-1] == "" and forcing.phase == "done"
    parser = ThinkerText()
    pieces = parser.feed("".join(written)) + parser.finish()
    calls = [p for p in pieces if isinstance(p, CallDone)]
    assert len(calls) == 1 and calls[0].name in names
    assert not isinstance(pieces[0], Speech), "the reply opens with the call"


def test_a_token_that_closes_the_arguments_and_the_call_is_not_closed_again():
    forcing = CallForcing(("f",), _chars, EOS)
    while forcing.phase == "head":
        forcing.advance(forcing.allowed(99)[0], "")
    forcing.advance(-1, '"a": "}"')
    assert forcing.allowed(99) is None, "a brace inside a string closes nothing"
    forcing.advance(-1, "}}\n")
    assert [chr(t) for t in iter_forced(forcing)] == list("</tool_call>")


def iter_forced(forcing: CallForcing):
    while (allowed := forcing.allowed(99)) != [EOS]:
        [token] = allowed
        forcing.advance(token, chr(token))
        yield token


def test_the_echo_oracle_replies_with_its_input_whatever_the_tool_choice():
    model = EchoModel()
    st = model.new_state("e")
    model.thinker_prefill([st], [TextTurn("no call here")])
    model.begin_response(st, ReplySpec(tools=TOOLS, tool_choice=NAMED))
    text = ""
    while not (tok := model.thinker_decode([st])[0]).finished:
        text += tok.text
    assert text + tok.text == "no call here"
