"""The Thinker's text split into speech and tool calls, whatever pieces it arrives in."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.engine.thinker_text import (
    CallArguments,
    CallDone,
    CallStarted,
    Speech,
    ThinkerText,
)


def run(chunks):
    parser = ThinkerText()
    pieces = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    return pieces + parser.finish()


def split(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def summary(pieces):
    speech = "".join(p.text for p in pieces if isinstance(p, Speech))
    done = [(p.name, p.arguments, p.valid) for p in pieces if isinstance(p, CallDone)]
    started = [p.name for p in pieces if isinstance(p, CallStarted)]
    streamed = {}
    for p in pieces:
        if isinstance(p, CallArguments):
            streamed[p.index] = streamed.get(p.index, "") + p.delta
    return speech, done, started, streamed


def test_speech_then_a_call_then_speech():
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call> One moment.')
    speech, done, started, streamed = summary(run([text]))
    assert speech == "Let me check.  One moment."
    assert done == [("get_weather", '{"city": "Paris"}', True)]
    assert started == ["get_weather"]
    assert streamed == {0: '{"city": "Paris"}'}


def test_a_call_streams_its_name_first_and_its_arguments_as_they_come():
    parser = ThinkerText()
    assert parser.feed("<tool_c") == []
    assert parser.feed('all>{"name": "f", "argu') == []
    # Trailing blanks and a final brace wait: they may end the call rather than its arguments.
    assert parser.feed('ments": {"a": ') == [CallStarted(0, "f"), CallArguments(0, '{"a":')]
    assert parser.feed("1}") == [CallArguments(0, " 1")]
    assert parser.feed("}</tool_call>") == [CallArguments(0, "}"), CallDone(0, "f", '{"a": 1}', True)]


def test_a_call_that_is_not_json_is_reported_with_its_raw_text():
    _, done, _, _ = summary(run(["<tool_call>call f with a=1</tool_call>"]))
    assert done == [("", "call f with a=1", False)]


def test_an_unclosed_call_at_the_end_is_still_reported():
    speech, done, _, _ = summary(run(['hi <tool_call>{"name": "f", "arguments": {}}']))
    assert speech == "hi " and done == [("f", "{}", True)]


def test_text_that_only_looks_like_a_tag_start_is_speech():
    speech, done, _, _ = summary(run(["a <tool and b <", "/tool_call> c <tool_"]))
    assert speech == "a <tool and b </tool_call> c <tool_" and done == []


calls = st.builds(
    lambda name, args: json.dumps({"name": name, "arguments": args}),
    st.text("abcdefgh_", min_size=1, max_size=8),
    st.dictionaries(st.text("xyz", min_size=1, max_size=3),
                    st.one_of(st.integers(), st.text(max_size=5),
                              st.dictionaries(st.text("pq", min_size=1, max_size=2), st.integers(),
                                              max_size=2)), max_size=3),
)
speech_text = st.text(st.characters(blacklist_characters="<"), max_size=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(speech_text, calls), max_size=3), speech_text,
       st.lists(st.integers(0, 400), max_size=12))
def test_any_split_of_the_stream_gives_the_same_speech_and_calls(parts, tail, cuts):
    text = "".join(f"{s}<tool_call>{c}</tool_call>" for s, c in parts) + tail
    whole = summary(run([text]))
    assert summary(run(split(text, cuts))) == whole
    speech, done, started, streamed = whole
    assert speech == "".join(s for s, _ in parts) + tail
    assert [(n, json.loads(a)) for n, a, _ in done] == [
        (json.loads(c)["name"], json.loads(c)["arguments"]) for _, c in parts]
    assert started == [n for n, _, _ in done]
    # What streamed adds up to exactly the arguments reported at the end.
    assert streamed == {i: a for i, (_, a, _) in enumerate(done)}
