"""What a reply is asked to be reaches the models: instructions and tools in the Thinker's
system turn, the voice, the sampling temperature; the echo oracle's text path."""

from __future__ import annotations

import numpy as np
import pytest

from models.base import ModelState, TextTurn
from models.echo import EchoModel
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.thinker import render_system
from models.reply import ReplySpec

OPTIONS = Qwen3OmniOptions(min_text_tokens=6, max_text_tokens=6, min_frames=4, max_frames=4)


@pytest.fixture(scope="module")
def adapter(tiny_omni_dir):
    return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)


def reply(ad: Qwen3OmniAdapter, spec: ReplySpec, sid: str = "s", instruct_first: bool = False):
    """The Thinker's token ids of one reply to the same text turn."""
    st = ad.new_state(sid)
    if instruct_first:
        ad.instruct(st, spec.instructions, spec.tools)
    ad.thinker_prefill([st], [TextTurn("what is the weather like")])
    ad.begin_response(st, spec)
    tokens = []
    while True:
        [tok] = ad.thinker_decode([st])
        tokens.append(ad._session(st).last_token)
        if tok.finished:
            break
    ad.free(st)
    return tokens


def test_greedy_replies_are_the_same_for_the_same_instructions_and_differ_for_others(adapter):
    greedy = ReplySpec(temperature=0.0, instructions="You are a pirate.")
    first = reply(adapter, greedy, "s1")
    again = reply(adapter, greedy, "s2")
    other = reply(adapter, ReplySpec(temperature=0.0, instructions="You are a lawyer."), "s3")
    assert first == again and len(first) == 6
    assert first != other


def test_instructions_set_before_any_input_open_the_context(adapter):
    spec = ReplySpec(temperature=0.0, instructions="Answer in French.")
    st = adapter.new_state("head")
    adapter.instruct(st, spec.instructions, spec.tools)
    sess = adapter._session(st)
    assert sess.keep == sess.next_pos > 0 and sess.system == "Answer in French."
    adapter.free(st)
    # Told first or only with the reply, the same instructions give the same reply: a
    # system turn at the head in one case, appended before the reply in the other, is not
    # the same context, so the replies are compared within each case.
    assert reply(adapter, spec, "a", True) == reply(adapter, spec, "b", True)


def test_tools_are_rendered_into_the_system_turn_as_the_template_does():
    tools = ({"type": "function", "name": "get_weather", "description": "Weather now.",
              "parameters": {"type": "object"}},)
    text = render_system("Be brief.", tools)
    assert text.startswith("Be brief.\n\n# Tools\n")
    assert ('<tools>\n{"type": "function", "function": {"name": "get_weather", '
            '"description": "Weather now.", "parameters": {"type": "object"}}}\n</tools>') in text
    assert text.endswith("</tool_call>")
    assert render_system("Be brief.", ()) == "Be brief."


def test_tool_choice_none_leaves_the_tools_out_of_the_system_turn(adapter):
    tools = ({"type": "function", "name": "get_weather", "parameters": {"type": "object"}},)
    systems = {}
    for choice in ("auto", "none"):
        st = adapter.new_state(choice)
        adapter.thinker_prefill([st], [TextTurn("what is the weather like")])
        adapter.begin_response(st, ReplySpec(instructions="Be brief.", tools=tools,
                                             tool_choice=choice))
        systems[choice] = adapter._session(st).system
        adapter.free(st)
    assert systems["auto"] == render_system("Be brief.", tools) and "<tools>" in systems["auto"]
    assert systems["none"] == "Be brief."


def reply_codes(ad: Qwen3OmniAdapter, text: str, voice: str, sid: str) -> list[list[int]]:
    """The codec frames of a greedy reply to `text` in `voice`."""
    st = ad.new_state(sid)
    ad.thinker_prefill([st], [TextTurn(text)])
    ad.begin_response(st, ReplySpec(temperature=0.0, voice=voice))
    frames = []
    while True:
        [tok] = ad.thinker_decode([st])
        [frame] = ad.talker_step([st], [tok])
        if frame.codes is not None:
            frames.append(frame.codes.tolist())
        if frame.finished:
            break
    ad.free(st)
    return frames


@pytest.mark.parametrize("text", ["speak", "in text", "hello there"])
def test_a_greedy_reply_is_the_same_audio_in_any_session_and_other_audio_in_another_voice(
        adapter, text):
    """Temperature 0 makes the codes greedy too: a session of its own (its own sampling
    generators) gives the same frames. The voice is the speaker position of the Talker's
    assistant prefix; another speaker gives other frames within the reply's four."""
    ethan = reply_codes(adapter, text, "ethan", "s1")
    assert len(ethan) == OPTIONS.max_frames
    assert reply_codes(adapter, text, "ethan", "s2") == ethan
    assert reply_codes(adapter, text, "chelsie", "s3") != ethan


def test_an_unknown_voice_is_refused_naming_the_voices(adapter):
    assert adapter.voices == ("aiden", "chelsie", "ethan") and adapter.default_voice == "ethan"
    with pytest.raises(ValueError, match="unknown voice 'alloy'; have aiden, chelsie, ethan"):
        adapter.begin_response(adapter.new_state("x"), ReplySpec(voice="alloy"))


def test_echo_replies_to_text_with_that_text_a_word_at_a_time():
    model = EchoModel()
    st = model.new_state("e")
    model.thinker_prefill([st], [TextTurn("the answer is 42", role="tool")])
    model.begin_response(st, ReplySpec())
    pieces = []
    while True:
        [tok] = model.thinker_decode([st])
        pieces.append(tok.text)
        assert len(tok.conditioning) == model.frame_samples
        if tok.finished:
            break
    assert pieces == ["the ", "answer ", "is ", "42"]
    # Audio after text: the audio echo as before.
    model.thinker_prefill([st], [np.ones(1920, np.float32)])
    model.begin_response(st)
    [tok] = model.thinker_decode([st])
    assert tok.text == "frame0 " and tok.finished


def test_models_without_a_system_turn_ignore_instructions():
    model = EchoModel()
    st: ModelState = model.new_state("e")
    model.instruct(st, "anything", ())
    assert model.bytes_held(st) == 0
