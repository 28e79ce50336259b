"""A Twilio call's Realtime view driven with plain calls: what a sideband's client events do to
the call, the events it is shown, and the errors that name what was wrong."""

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.engine.thinker_text import CallArguments, CallDone, CallStarted
from duplex.transport.effects import (
    EngineCancel,
    EngineCommit,
    EngineInstruct,
    EnginePushText,
    Send,
)
from duplex.transport.twilio.realtime_view import Publish
from tests.transport.test_twilio_protocol import QUIET, SILENCE_PROBS, SPEECH, started

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def events(effects) -> list[dict]:
    return [e.event for e in effects if isinstance(e, Publish)]


def ask(p, event: dict) -> list:
    return p.receive_sideband(json.dumps(event))


def error_of(effects) -> dict:
    [event] = events(effects)
    assert event["type"] == "error"
    return event["error"]


def test_a_sidebands_events_act_on_the_call():
    p, peer = started()
    assert p.view.attached()["session"]["id"] == "call_t"

    effects = ask(p, {"type": "session.update", "session": {
        "type": "realtime", "instructions": "Be brief.", "tools": [WEATHER]}})
    assert [e["type"] for e in events(effects)] == ["session.updated"]
    assert EngineInstruct("Be brief.", (WEATHER,)) in effects

    effects = ask(p, {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
    assert EnginePushText("Hi", "user") in effects

    # A reply the sideband asks for is the call's: told the session's instructions and tools.
    effects = ask(p, {"type": "response.create"})
    [commit] = [e for e in effects if isinstance(e, EngineCommit)]
    assert (commit.spec.instructions, commit.spec.tools) == ("Be brief.", (WEATHER,))
    assert [e["type"] for e in events(effects)] == ["response.created",
                                                    "response.output_item.added"]
    response_id = events(effects)[0]["response"]["id"]
    busy = ask(p, {"type": "response.create"})
    assert error_of(busy)["code"] == "conversation_already_has_active_response"

    # The model's call reaches the sideband, and its output is then the call's to hear.
    shown = []
    for piece in (CallStarted(0, "get_weather"), CallArguments(0, '{"city": "Oslo"}'),
                  CallDone(0, "get_weather", '{"city": "Oslo"}', True)):
        shown += events(p.on_engine_tool_call(commit.epoch, piece))
    done = next(e for e in shown if e["type"] == "response.function_call_arguments.done")
    assert (done["response_id"], done["arguments"]) == (response_id, '{"city": "Oslo"}')
    effects = ask(p, {"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": done["call_id"], "output": "Sunny"}})
    assert EnginePushText("Sunny", "tool") in effects

    # A cancel cuts the reply as a barge-in would.
    p.on_engine_audio(commit.epoch, np.zeros(800, np.float32), "Hello ")
    p.release_output(0)
    effects = ask(p, {"type": "response.cancel"})
    assert EngineCancel(commit.epoch + 1) in effects
    assert any(isinstance(e, Send) and e.event["event"] == "clear" for e in effects)
    [cancelled] = [e for e in events(effects) if e["type"] == "response.done"]
    assert cancelled["response"]["status"] == "cancelled"
    assert cancelled["response"]["output"][1]["call_id"] == done["call_id"]
    assert error_of(ask(p, {"type": "response.cancel"}))["code"] == "response_cancel_not_active"

    # The caller's turns show as speech events, and end in a reply the sideband sees start.
    peer.media()
    shown = events(p.on_vad([SPEECH] * 4)) + events(p.on_vad([QUIET] * SILENCE_PROBS))
    assert [e["type"] for e in shown][:3] == ["input_audio_buffer.speech_started",
                                              "input_audio_buffer.speech_stopped",
                                              "response.created"]
    p.close()
    assert ask(p, {"type": "response.cancel"}) == []


def test_what_a_twilio_call_cannot_take_is_an_error_naming_it():
    p, _ = started()
    assert error_of(p.receive_sideband(b"\x00"))["code"] == "invalid_frame"
    assert error_of(p.receive_sideband("nope"))["code"] == "invalid_json"
    assert error_of(ask(p, {"type": "input_audio_buffer.append", "audio": ""}))["param"] == "type"
    for session, param in [({"audio": {"output": {"speed": 1.5}}}, "session.audio"),
                           ({"tools": [{"type": "mcp", "server_label": "crm",
                                        "server_url": "http://x"}]}, "session.tools.0.type"),
                           ({"tools": [{"type": "function"}]}, "session.tools.0.name")]:
        error = error_of(ask(p, {"type": "session.update", "session": session}))
        assert error["param"] == param, error
    unknown = ask(p, {"type": "conversation.item.create", "event_id": "ev1", "item": {
        "type": "function_call_output", "call_id": "call_nope", "output": "x"}})
    assert (error_of(unknown)["code"], error_of(unknown)["event_id"]) == (
        "invalid_tool_call_id", "ev1")
    audio = ask(p, {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": ""}]}})
    assert error_of(audio)["param"] == "item.content"
    assert error_of(ask(p, {"type": "response.create", "response": {"instructions": "x"}}))[
        "param"] == "response"


sideband_events = st.fixed_dictionaries(
    {"type": st.sampled_from(["session.update", "response.create", "response.cancel",
                              "conversation.item.create", "session.resume", "x"])},
    optional={
        "session": st.one_of(st.just({"instructions": "x"}), st.just({"tools": [WEATHER]}),
                             st.just({"audio": {}}), st.just([]), st.just({"tools": "x"})),
        "item": st.one_of(st.just({"type": "function_call_output", "call_id": "c",
                                   "output": "o"}),
                          st.just({"role": "user", "content": [{"type": "input_text",
                                                                "text": "t"}]}),
                          st.just({"type": "function_call", "call_id": "c", "name": "n"}),
                          st.just({"type": "message"}), st.just(3)),
        "response": st.one_of(st.none(), st.just({}), st.just({"tools": []})),
    },
).map(json.dumps)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(sideband_events, st.text(max_size=20), st.binary(max_size=4)),
                          st.booleans()), max_size=12))
def test_fuzzed_sideband_frames_never_crash_the_call(steps):
    p, _ = started()
    for now, (frame, finish) in enumerate(steps):
        effects = p.receive_sideband(frame)
        if finish and p.reply is not None:
            p.on_engine_audio(p.reply.epoch, np.zeros(320, np.float32), "x ")
            p.on_engine_finished(p.reply.epoch)
        effects += p.release_output(now * 320)
        for event in events(effects):
            json.dumps(event)
            assert event["type"] != "error" or event["error"]["code"]
    p.close()
