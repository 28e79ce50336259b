"""Replies as the engine shapes them, through the pure Realtime core: text-only replies sent as
written, function calls with their own items and events, replies cut at their token limit."""

import json

import numpy as np

from duplex.engine.thinker_text import CallArguments, CallDone, CallStarted
from duplex.transport.effects import EngineCommit, InvalidToolCall, Send
from duplex.transport.realtime.protocol import Limits, RealtimeProtocol


def make():
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000, model_output_rate=24000,
                         limits=Limits(max_errors=1000))
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
    assert (spec.audio, spec.max_output_tokens, spec.instructions, spec.voice) == (
        False, 50, "Just this once.", "marin")
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
