"""Replies as the engine shapes them, through the pure Realtime core: text-only replies sent as
written, function calls with their own items and events, replies cut at their token limit."""

import json

import numpy as np

from duplex.engine.thinker_text import CallArguments, CallDone, CallStarted
from duplex.transport.effects import (
    EngineCommit,
    EngineInstruct,
    EnginePushText,
    InvalidToolCall,
    Send,
)
from duplex.transport.realtime.protocol import Limits, RealtimeProtocol
from duplex.transport.realtime.session_config import Voices


def make(**kwargs):
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000, model_output_rate=24000,
                         limits=Limits(max_errors=1000), **kwargs)
    p.start()
    p.receive_text(json.dumps({"type": "session.update",
                               "session": {"audio": {"input": {"turn_detection": None}}}}))
    return p


def events(effects):
    return [e.event for e in effects if isinstance(e, Send)]


def create(p, **response):
    effects = p.receive_text(json.dumps({"type": "response.create", "response": response}))
    [commit] = [e for e in effects if isinstance(e, EngineCommit)]
    return commit


def test_the_reply_spec_carries_what_the_session_and_the_response_ask():
    p = make()
    p.receive_text(json.dumps({"type": "session.update", "session": {
        "instructions": "Be brief.", "max_output_tokens": 50,
        "tools": [{"type": "function", "name": "f"}],
        "audio": {"output": {"voice": "marin"}}}}))
    spec = create(p, output_modalities=["text"], instructions="Just this once.").spec
    # OpenAI's voice names ask for the model's default speaker.
    assert (spec.audio, spec.max_output_tokens, spec.instructions, spec.voice) == (
        False, 50, "Just this once.", None)
    assert spec.tools == ({"type": "function", "name": "f"},)


def test_text_only_text_is_sent_as_written_and_the_reply_ends_with_the_engine():
    p = make()
    epoch = create(p, output_modalities=["text"]).epoch
    out = events(p.on_engine_text(epoch, "Hel")) + events(p.on_engine_text(epoch, "lo"))
    assert [e["delta"] for e in out] == ["Hel", "lo"]
    assert {e["type"] for e in out} == {"response.output_text.delta"}
    p.on_engine_finished(epoch)
    done = events(p.release_output(0))
    assert [e["type"] for e in done][-1] == "response.done"
    assert done[-1]["response"]["output"][0]["content"] == [{"type": "output_text", "text": "Hello"}]


def test_a_function_call_gets_its_item_its_argument_deltas_and_its_place_in_the_output():
    p = make()
    epoch = create(p).epoch
    p.on_engine_audio(epoch, np.zeros(1920, np.float32), "Let me look. ")
    out = []
    for piece in (CallStarted(0, "lookup"), CallArguments(0, '{"q": '), CallArguments(0, '"x"}'),
                  CallDone(0, "lookup", '{"q": "x"}', True)):
        out += events(p.on_engine_tool_call(epoch, piece))
    names = [e["type"] for e in out]
    assert names == ["conversation.item.added", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "conversation.item.done"]
    added = out[1]
    assert added["output_index"] == 1 and added["item"]["type"] == "function_call"
    assert added["item"]["name"] == "lookup" and added["item"]["call_id"].startswith("call_")
    assert "".join(e["delta"] for e in out if e["type"].endswith("arguments.delta")) == '{"q": "x"}'
    assert out[4]["arguments"] == '{"q": "x"}' and out[4]["call_id"] == added["item"]["call_id"]
    p.on_engine_finished(epoch)
    done = [e for e in events(p.release_output(24000)) if e["type"] == "response.done"][0]
    output = done["response"]["output"]
    assert [i["type"] for i in output] == ["message", "function_call"]
    assert output[0]["content"][0]["transcript"] == "Let me look. "
    assert output[1]["status"] == "completed" and output[1]["arguments"] == '{"q": "x"}'
    # The client answers the call; the output joins the conversation after it.
    answer = p.receive_text(json.dumps({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": output[1]["call_id"], "output": "42"}}))
    assert events(answer)[0]["previous_item_id"] == output[1]["id"]


def test_a_call_that_is_not_json_is_reported_raw_and_counted():
    p = make()
    epoch = create(p).epoch
    effects = p.on_engine_tool_call(epoch, CallDone(0, "", "call lookup now", False))
    assert [e for e in effects if isinstance(e, InvalidToolCall)] == [
        InvalidToolCall("", "call lookup now")]
    done = [e for e in events(effects) if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == "call lookup now"


def test_a_reply_cut_at_its_token_limit_is_incomplete_with_that_reason():
    p = make()
    epoch = create(p, output_modalities=["text"], max_output_tokens=3).epoch
    p.on_engine_text(epoch, "abc")
    p.on_engine_finished(epoch, "max_output_tokens")
    done = [e for e in events(p.release_output(0)) if e["type"] == "response.done"][0]["response"]
    assert done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens",
                                      "error": None}
    assert done["output"][0]["status"] == "incomplete"


def send(p, **event):
    return p.receive_text(json.dumps(event))


def error_of(effects):
    [error] = [e for e in events(effects) if e["type"] == "error"]
    return error["error"]


def test_a_models_own_voice_is_asked_for_and_an_unknown_one_is_named_with_the_choices():
    p = make(voices=Voices(("aiden", "ethan"), "ethan"))
    send(p, type="session.update", session={"audio": {"output": {"voice": "aiden"}}})
    assert create(p).spec.voice == "aiden"
    err = error_of(send(p, type="session.update", session={"audio": {"output": {"voice": "bob"}}}))
    assert (err["code"], err["param"]) == ("invalid_value", "session.audio.output.voice")
    assert "aiden, ethan, alloy" in err["message"]
    assert p.settings.voice == "aiden"


def test_the_voice_cannot_change_once_the_session_has_produced_audio():
    p = make(voices=Voices(("aiden", "ethan"), "ethan"))
    epoch = create(p).epoch
    p.on_engine_audio(epoch, np.zeros(1920, np.float32), "hi")
    err = error_of(send(p, type="session.update", session={"audio": {"output": {"voice": "aiden"}}}))
    assert (err["code"], err["param"]) == ("cannot_update_voice", "session.audio.output.voice")
    # The session goes on: other settings still change.
    assert events(send(p, type="session.update", session={"instructions": "x"}))[0]["type"] == (
        "session.updated")


def test_the_engine_is_told_instructions_and_tools_when_they_change():
    p = RealtimeProtocol("s", model="echo", model_input_rate=24000, model_output_rate=24000)
    p.configure({"instructions": "From the key."})
    assert [e for e in p.start() if isinstance(e, EngineInstruct)] == [
        EngineInstruct("From the key.", ())]
    tools = [{"type": "function", "name": "f"}]
    told = [e for e in send(p, type="session.update", session={"tools": tools})
            if isinstance(e, EngineInstruct)]
    assert told == [EngineInstruct("From the key.", ({"type": "function", "name": "f"},))]
    assert not [e for e in send(p, type="session.update", session={"tools": tools})
                if isinstance(e, EngineInstruct)]


def test_a_tool_output_needs_its_call_and_enters_the_model_as_a_tool_turn():
    p = make()
    err = error_of(send(p, type="conversation.item.create", item={
        "type": "function_call_output", "call_id": "call_nope", "output": "x"}))
    assert err["param"] == "item.call_id" and "call_nope" in err["message"]
    send(p, type="conversation.item.create", item={
        "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"})
    effects = send(p, type="conversation.item.create", item={
        "type": "function_call_output", "call_id": "call_1", "output": "sunny"})
    assert [e for e in effects if isinstance(e, EnginePushText)] == [
        EnginePushText("sunny", role="tool")]


def test_idle_timeout_says_so_once_and_replies():
    p = make()
    send(p, type="session.update", session={"audio": {"input": {"turn_detection": {
        "type": "server_vad", "idle_timeout_ms": 5000}}}})
    assert not events(p.release_output(0))
    assert not events(p.release_output(24000 * 4))
    fired = events(p.release_output(24000 * 5))
    names = [e["type"] for e in fired]
    assert names[0] == "input_audio_buffer.timeout_triggered"
    assert "input_audio_buffer.committed" in names and "response.created" in names
    assert fired[0]["audio_end_ms"] - fired[0]["audio_start_ms"] == 5000


def test_semantic_vad_eagerness_sets_how_long_a_pause_ends_the_turn():
    p = make()
    for eagerness, ms in (("high", 300), ("low", 1500), ("auto", 800)):
        send(p, type="session.update", session={"audio": {"input": {"turn_detection": {
            "type": "semantic_vad", "eagerness": eagerness}}}})
        assert p.detector.silence_samples == ms * 24
