"""`tool_choice` "required" and a named function make the Qwen3-Omni reply a call (constrained
decoding, per row of the batch) whose arguments follow the tool's schema, as does a call the
model opens itself; "auto" replies as it did. The reply's text is read by the engine's own
Thinker-output parser, as a served reply is."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.engine.thinker_text import CallDone, Speech, ThinkerText
from models.base import TextTurn
from models.echo import EchoModel
from models.qwen3_omni.adapter import Qwen3OmniAdapter
from models.qwen3_omni.options import Qwen3OmniOptions
from models.qwen3_omni.tiny import load_options
from models.reply import ReplySpec
from models.tool_forcing import OPEN, CallForcing, forced_names

pytestmark = pytest.mark.cpu_bound

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
    """With room for no argument at all, or a little, the call is still whole: `{}`."""
    limit = adapter._thinker.forcing(NAMED, TOOLS).overhead + slack
    [ids] = replies(adapter, [spec(NAMED, max_output_tokens=limit)])
    assert len(ids) <= limit and ids[-1] in adapter._thinker.ids["eos"]
    [call] = parsed(adapter, ids)
    assert call.name == "get_weather" and call.valid
    assert json.loads(call.arguments) == {}


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


TOOL = "act"
SCHEMAS = {
    "no parameters": None,
    "required strings, ints and enums": {
        "type": "object", "required": ["city", "days", "unit"],
        "properties": {"city": {"type": "string"},
                       "days": {"type": "integer", "minimum": 1, "maximum": 14},
                       "unit": {"enum": ["celsius", "fahrenheit"]}}},
    "nested objects": {
        "type": "object", "required": ["trip"],
        "properties": {
            "trip": {"type": "object", "required": ["from", "stops"], "properties": {
                "from": {"type": "string", "maxLength": 12},
                "stops": {"type": "array", "items": {
                    "type": "object", "required": ["at"],
                    "properties": {"at": {"type": "string"}, "nights": {"type": "integer"}}}}}},
            "rush": {"type": "boolean"}}},
}


def tool_of(parameters) -> dict:
    tool = {"type": "function", "name": TOOL}
    return tool if parameters is None else {**tool, "parameters": parameters}


def valid_call(ad: Qwen3OmniAdapter, ids: list[int], parameters, opened: bool = False) -> dict:
    """The call the reply wrote, its arguments checked against the tool's schema."""
    text = ad.tokenizer.decode(ids, skip_special_tokens=True)
    calls = [p for p in parsed_text(OPEN + text if opened else text)
             if isinstance(p, CallDone)]
    assert len(calls) == 1 and calls[0].valid, f"not one call: {text!r}"
    arguments = json.loads(calls[0].arguments)
    jsonschema.validate(arguments, parameters or {"type": "object"})
    return arguments


def parsed_text(text: str) -> list:
    parser = ThinkerText()
    return parser.feed(text) + parser.finish()


@pytest.mark.parametrize("schema", SCHEMAS)
def test_a_forced_calls_arguments_follow_its_tools_schema(adapter, schema):
    """Greedy and sampled rows of one batch, with room to write and with just the room the
    call needs: on random weights every call parses and validates."""
    tools = (tool_of(SCHEMAS[schema]),)
    choice = {"type": "function", "name": TOOL}
    tight = adapter._thinker.forcing(choice, tools).overhead + 2
    specs = [ReplySpec(temperature=t, tools=tools, tool_choice=choice, max_output_tokens=limit)
             for t in (0.0, 1.0) for limit in (None, tight)]
    for ids, spec in zip(replies(adapter, specs), specs, strict=True):
        assert ids[-1] in adapter._thinker.ids["eos"]
        assert spec.max_output_tokens is None or len(ids) <= spec.max_output_tokens
        valid_call(adapter, ids, SCHEMAS[schema])


@pytest.fixture(scope="module")
def roomy(tiny_omni_dir):
    """The tiny model with replies long enough for a call it opens itself."""
    options = Qwen3OmniOptions(**{**load_options(tiny_omni_dir), "max_text_tokens": 160})
    return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=options)


def test_a_call_the_model_opens_itself_follows_the_schema_and_the_reply_goes_on(roomy):
    parameters = SCHEMAS["required strings, ints and enums"]
    state = roomy.new_state("opens")
    roomy.thinker_prefill([state], [TextTurn("what is the weather like")])
    roomy.begin_response(state, ReplySpec(temperature=1.0, tools=(tool_of(parameters),)))
    sess = roomy._session(state)
    # The random model would never write the tag itself; here it just has.
    roomy._thinker._watch_call(sess, "Let me look. " + OPEN)
    assert sess.forcing is not None
    ids = []
    while not (token := roomy.thinker_decode([state])[0]).finished:
        ids.append(token.token_id)
        if sess.forcing is None:
            break
    assert sess.forcing is None, "the call closed and the reply is free again"
    valid_call(roomy, ids, parameters, opened=True)
    roomy.free(state)


KEYS = st.sampled_from(["a", "city", "n", "long_key_name", "x y"])
LEAVES = st.one_of(
    st.just({"type": "string"}),
    st.integers(0, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.just({"type": "integer"}),
    st.integers(-20, 20).map(lambda lo: {"type": "integer", "minimum": lo}),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "x y", 'q"q', "ü"]), min_size=1, max_size=3,
             unique=True).map(lambda values: {"enum": values}),
)


def _objects(children) -> st.SearchStrategy:
    return st.dictionaries(KEYS, children, max_size=4).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props) or ["_"])).map(
            lambda required: {"type": "object", "properties": props,
                              "required": sorted(required & set(props))}))


SCHEMA_TREES = _objects(st.recursive(LEAVES, lambda children: st.one_of(
    st.tuples(children, st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1]}),
    _objects(children)), max_leaves=6))


@settings(max_examples=120, deadline=None)
@given(st.lists(SCHEMA_TREES, min_size=1, max_size=3), st.integers(0, 40), st.randoms())
def test_whatever_the_model_picks_a_forced_call_validates_within_its_budget(adapter, schemas,
                                                                           slack, rng):
    """A model that picks any token the grammar allows, for random schemas and budgets,
    writes one call of an allowed name whose arguments validate, then the end of its turn,
    within the budget."""
    vocab = adapter._thinker.vocabulary()
    tools = [{"name": f"tool{i}", "parameters": schema} for i, schema in enumerate(schemas)]
    forcing = CallForcing(vocab, tools, [t["name"] for t in tools])
    budget = forcing.overhead + slack
    row = np.zeros(vocab.words, np.int32)
    written: list[int] = []
    while len(written) < budget and vocab.eos not in written:
        forcing.fill(row, budget - len(written))
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        token = int(rng.choice(allowed))
        forcing.advance(token)
        written.append(token)
    assert written[-1] == vocab.eos
    text = vocab.tokenizer.decode_str(written[:-1])
    [call] = [p for p in parsed_text(text) if isinstance(p, CallDone)]
    assert call.valid and text.startswith(OPEN)
    jsonschema.validate(json.loads(call.arguments), schemas[int(call.name[4:])])


def test_the_echo_oracle_replies_with_its_input_whatever_the_tool_choice():
    model = EchoModel()
    st = model.new_state("e")
    model.thinker_prefill([st], [TextTurn("no call here")])
    model.begin_response(st, ReplySpec(tools=TOOLS, tool_choice=NAMED))
    text = ""
    while not (tok := model.thinker_decode([st])[0]).finished:
        text += tok.text
    assert text + tok.text == "no call here"
