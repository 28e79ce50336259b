"""What agent frameworks rely on, driven through the pure Realtime core: truncation bounded by
delivery, opt-in extension events, response metadata, function-call items, text-only
spellings, and the whole effective session echoed back."""

import base64
import json

import numpy as np
import pytest

from duplex.transport.effects import EngineCommit, Send
from duplex.transport.realtime.protocol import Limits, RealtimeProtocol

FRAME = 1920  # 80 ms at 24 kHz


MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "whisper-tiny.en")


def make(beta=False, **kwargs):
    kwargs.setdefault("transcription_models", MODELS)
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000, model_output_rate=24000,
                         beta=beta, limits=Limits(max_errors=1000, output_lead_ms=200), **kwargs)
    p.start()
    return p


def sent(effects):
    return [e.event for e in effects if isinstance(e, Send)]


def send(p, **event):
    return p.receive_text(json.dumps(event))


def types(effects):
    return [e["type"] for e in sent(effects)]


def error_of(effects):
    [event] = [e for e in sent(effects) if e["type"] == "error"]
    return event["error"]


def manual(p):
    send(p, type="session.update", session={"audio": {"input": {"turn_detection": None}}})


def reply(p, frames=5, text="w ", response=None, now=0):
    """Start a reply and give it `frames` frames of audio, each carrying `text`; returns the
    events up to the release at `now` and the reply's epoch."""
    effects = send(p, type="response.create", **({"response": response} if response else {}))
    epoch = next(e.epoch for e in effects if isinstance(e, EngineCommit))
    for _ in range(frames):
        p.on_engine_audio(epoch, np.zeros(FRAME, np.float32), text)
    return sent(effects) + sent(p.release_output(now)), epoch


def finish(p, epoch, now):
    p.on_engine_finished(epoch)
    return sent(p.release_output(now))


def test_a_truncate_after_barge_in_is_bounded_by_what_was_delivered_not_the_estimate():
    p = make()
    manual(p)
    events, _ = reply(p, frames=25, text="word ")
    item_id = next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added")
    for now in range(0, 24001, 480):  # the session loop's 20 ms ticks, for 1 s
        p.release_output(now)
    # 1 s played by the server's estimate; 1.2 s delivered, with the 200 ms lead.
    delivered_ms = p.core.responses[0].delivered_samples * 1000 // 24000
    assert delivered_ms == 1200
    cancelled = send(p, type="response.cancel")
    assert "response.done" in types(cancelled)
    # The client played 1.1 s (its buffer ran ahead of the server's estimate): it is right.
    ok = send(p, type="conversation.item.truncate", item_id=item_id, content_index=0,
              audio_end_ms=1100)
    assert types(ok) == ["conversation.item.truncated"]
    [retrieved] = sent(send(p, type="conversation.item.retrieve", item_id=item_id))
    assert retrieved["item"]["content"][0]["transcript"] == "word " * 14
    err = error_of(send(p, type="conversation.item.truncate", item_id=item_id, content_index=0,
                        audio_end_ms=delivered_ms + 1))
    assert (err["code"], err["param"]) == ("invalid_value", "audio_end_ms")
    assert "delivered" in err["message"]


def test_a_truncate_of_a_finished_reply_cuts_the_output_track_at_the_listeners_position():
    p = make()
    manual(p)
    events, epoch = reply(p, frames=3, text="a ")
    item_id = next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added")
    done = finish(p, epoch, 24000)
    assert "response.done" in [e["type"] for e in done]
    assert sent(send(p, type="conversation.item.truncate", item_id=item_id, content_index=0,
                     audio_end_ms=100))[0]["audio_end_ms"] == 100
    assert p.core.sent_samples == p.core.played_samples == 2400


def test_duplex_events_are_off_unless_asked_for():
    p = make()
    manual(p)
    reply(p)
    assert not sent(p.on_engine_timings({"input": 1.0}))
    assert "duplex_events" not in sent(send(p, type="session.update", session={}))[0]["session"]
    updated = sent(send(p, type="session.update", session={"duplex_events": True}))[0]
    assert updated["session"]["duplex_events"] is True
    [timings] = sent(p.on_engine_timings({"input": 1.0}))
    assert timings["type"] == "duplex.response.timings"
    q = make(duplex_events=True)
    manual(q)
    reply(q)
    assert types(q.on_engine_timings({"input": 1.0})) == ["duplex.response.timings"]


@pytest.mark.parametrize("beta", [False, True])
def test_response_created_and_done_carry_what_response_create_set(beta):
    p = make(beta=beta)
    send(p, type="session.update", session={"turn_detection": None} if beta else
         {"audio": {"input": {"turn_detection": None}}})
    modalities = "modalities" if beta else "output_modalities"
    tokens = "max_response_output_tokens" if beta else "max_output_tokens"
    params = {"metadata": {"client_event_id": "ce_1"}, modalities: ["text"], tokens: 200}
    events, epoch = reply(p, response=params)
    events += finish(p, epoch, 24000)
    by_type = {e["type"]: e for e in events}
    for name in ("response.created", "response.done"):
        response = by_type[name]["response"]
        assert response["metadata"] == {"client_event_id": "ce_1"}
        assert response[modalities] == ["text"]
        assert response["max_output_tokens"] == 200
        assert response["conversation_id"].startswith("conv_")
    # A VAD-started reply in the same session has the session's own settings again.
    events, _ = reply(p)
    created = next(e for e in events if e["type"] == "response.created")["response"]
    assert created["metadata"] is None and created[modalities] == ["audio"]


def test_function_call_items_are_stored_and_a_response_follows():
    p = make()
    manual(p)
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    effects = send(p, type="conversation.item.create", item=call)
    assert types(effects) == ["conversation.item.added", "conversation.item.done"]
    added = sent(effects)[0]["item"]
    assert {k: added[k] for k in call} == call
    output = {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}
    effects = send(p, type="conversation.item.create", item=output)
    stored = sent(effects)[0]["item"]
    assert (stored["type"], stored["call_id"], stored["output"]) == (
        "function_call_output", "call_1", '{"temp": 21}')
    assert sent(effects)[0]["previous_item_id"] == added["id"]
    [retrieved] = sent(send(p, type="conversation.item.retrieve", item_id=stored["id"]))
    assert retrieved["item"] == stored
    events, epoch = reply(p)
    assert "error" not in [e["type"] for e in events]
    assert "response.done" in [e["type"] for e in finish(p, epoch, 24000)]


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call_output", "output": "x"}, "item.call_id"),
    ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "item.name"),
    ({"type": "function_call_output", "call_id": "c", "output": 5}, "item.output"),
    ({"type": "reasoning"}, "item.type"),
    ({"type": "message", "content": []}, "item.role"),
])
def test_bad_items_are_named(item, param):
    err = error_of(send(make(), type="conversation.item.create", item=item))
    assert (err["code"], err["param"]) == ("invalid_value", param)


def test_items_go_where_previous_item_id_says():
    p = make()
    first = sent(send(p, type="conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "1"}]}))[0]
    second = sent(send(p, type="conversation.item.create", previous_item_id="root", item={
        "type": "message", "role": "system", "content": [{"type": "input_text", "text": "0"}]}))[0]
    assert second["previous_item_id"] is None
    assert [i.id for i in p.conversation] == [second["item"]["id"], first["item"]["id"]]


@pytest.mark.parametrize("beta", [False, True])
def test_text_only_replies_use_the_text_spellings(beta):
    p = make(beta=beta)
    if beta:
        send(p, type="session.update", session={"turn_detection": None, "modalities": ["text"]})
    else:
        send(p, type="session.update", session={"output_modalities": ["text"],
                                                "audio": {"input": {"turn_detection": None}}})
    events, epoch = reply(p, frames=2, text="hi ")
    events += finish(p, epoch, 24000)
    names = [e["type"] for e in events]
    delta = "response.text.delta" if beta else "response.output_text.delta"
    done = "response.text.done" if beta else "response.output_text.done"
    assert names.count(delta) == 2 and done in names
    assert not [n for n in names if "audio" in n]
    by_type = {e["type"]: e for e in events}
    assert by_type["response.content_part.added"]["part"] == {"type": "text", "text": ""}
    assert by_type[done]["text"] == "hi hi "
    [item] = by_type["response.done"]["response"]["output"]
    assert item["content"] == [{"type": "output_text", "text": "hi hi "}]


def test_session_updated_echoes_the_whole_effective_session():
    p = make()
    tools = [{"type": "function", "name": "lookup", "description": "Find a thing.",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    session = {
        "type": "realtime", "instructions": "Be brief.", "tools": tools,
        "tool_choice": {"type": "function", "name": "lookup"}, "max_output_tokens": 300,
        "truncation": {"type": "retention_ratio", "retention_ratio": 0.5},
        "audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe", "language": "en"},
                            "noise_reduction": {"type": "far_field"},
                            "turn_detection": {"type": "semantic_vad", "eagerness": "high"}},
                  "output": {"voice": "marin", "speed": 1.2}},
    }
    echoed = sent(send(p, type="session.update", session=session))[0]["session"]
    assert echoed["tools"] == tools
    assert echoed["tool_choice"] == {"type": "function", "name": "lookup"}
    assert echoed["instructions"] == "Be brief."
    assert echoed["max_output_tokens"] == 300
    assert echoed["truncation"] == {"type": "retention_ratio", "retention_ratio": 0.5}
    assert echoed["audio"]["input"]["transcription"] == {"model": "gpt-4o-mini-transcribe",
                                                         "language": "en"}
    assert echoed["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
    assert echoed["audio"]["input"]["turn_detection"]["eagerness"] == "high"
    assert echoed["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000},
                                         "voice": "marin", "speed": 1.2}
    # A later update changes only what it names.
    again = sent(send(p, type="session.update", session={"instructions": "Be kind."}))[0]
    assert again["session"]["tools"] == tools and again["session"]["audio"]["output"]["voice"] == "marin"


def test_beta_session_updated_echoes_its_own_spellings():
    p = make(beta=True)
    echoed = sent(send(p, type="session.update", session={
        "voice": "verse", "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
        "input_audio_transcription": {"model": "whisper-1"}, "temperature": 0.7,
        "max_response_output_tokens": "inf"}))[0]["session"]
    assert (echoed["voice"], echoed["tool_choice"], echoed["temperature"]) == ("verse", "required", 0.7)
    assert echoed["tools"] == [{"type": "function", "name": "f"}]
    assert echoed["input_audio_transcription"] == {"model": "whisper-1"}
    assert echoed["max_response_output_tokens"] == "inf"


@pytest.mark.parametrize("session, param", [
    ({"tools": [{"type": "computer", "name": "x"}]}, "session.tools.0"),
    ({"tools": [{"type": "mcp", "name": "x"}]}, "session.tools.0.server_label"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "session.tools.0.name"),
    ({"tool_choice": "sometimes"}, "session.tool_choice"),
    ({"tool_choice": {"type": "mcp", "server_label": "missing"}},
     "session.tool_choice.server_label"),
    ({"tool_choice": {"type": "function", "name": "missing"}}, "session.tool_choice.name"),
    ({"max_output_tokens": 0}, "session.max_output_tokens"),
    ({"max_output_tokens": 5000}, "session.max_output_tokens"),
    ({"truncation": "sometimes"}, "session.truncation"),
    ({"audio": {"input": {"noise_reduction": {"type": "loud"}}}},
     "session.audio.input.noise_reduction.type"),
    ({"audio": {"output": {"speed": 3}}}, "session.audio.output.speed"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 10}}}},
     "session.audio.input.turn_detection.idle_timeout_ms"),
    ({"output_modalities": ["text", "audio"]}, "session.output_modalities"),
])
def test_bad_session_values_are_named_and_change_nothing(session, param):
    p = make()
    before = p.session_object()
    err = error_of(send(p, type="session.update", session=session))
    assert err["param"] == param, err
    assert p.session_object() == before


@pytest.mark.parametrize("response, param", [
    ({"metadata": {"k": "v" * 513}}, "response.metadata.k"),
    ({"conversation": "elsewhere"}, "response.conversation"),
    ({"output_modalities": ["video"]}, "response.output_modalities.0"),
    ({"output_modalities": ["audio", "text"]}, "response.output_modalities"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "response.tool_choice.name"),
    ({"audio": {"output": {"voice": "nobody"}}}, "response.audio.output.voice"),
])
def test_bad_response_values_are_named_and_no_reply_starts(response, param):
    p = make()
    manual(p)
    effects = send(p, type="response.create", response=response)
    assert error_of(effects)["param"] == param
    assert p.response is None and not [e for e in effects if isinstance(e, EngineCommit)]


def test_ga_cannot_ask_for_text_and_audio_at_once_but_beta_spells_audio_so():
    p = make()
    manual(p)
    for event in ({"type": "session.update", "session": {"output_modalities": ["audio", "text"]}},
                  {"type": "response.create", "response": {"output_modalities": ["text", "audio"]}}):
        err = error_of(send(p, **event))
        assert err["code"] == "invalid_value" and "both text and audio" in err["message"]
    assert p.session_object()["output_modalities"] == ["audio"] and p.response is None
    events, _ = reply(p)
    assert "response.output_audio.delta" in [e["type"] for e in events]

    beta = make(beta=True)
    updated = sent(send(beta, type="session.update",
                        session={"turn_detection": None, "modalities": ["audio", "text"]}))
    assert updated[0]["session"]["modalities"] == ["audio", "text"]
    events, _ = reply(beta, response={"modalities": ["text", "audio"]})
    assert "response.audio.delta" in [e["type"] for e in events]


def test_an_out_of_band_reply_stays_out_of_the_conversation():
    p = make()
    manual(p)
    events, epoch = reply(p, response={"conversation": "none", "metadata": {"topic": "x"}})
    events += finish(p, epoch, 24000)
    names = [e["type"] for e in events]
    assert "conversation.item.added" not in names and "conversation.item.done" not in names
    done = next(e for e in events if e["type"] == "response.done")["response"]
    assert done["conversation_id"] is None and len(done["output"]) == 1
    assert len(p.conversation) == 0


def test_a_committed_audio_item_is_transcribed_and_its_transcript_kept():
    from duplex.transport.realtime.protocol import Transcribe

    p = make()
    send(p, type="session.update", session={"audio": {"input": {
        "turn_detection": None, "transcription": {"model": "whisper-1"}}}})
    send(p, type="input_audio_buffer.append", audio=base64.b64encode(bytes(2 * 4800)).decode())
    effects = send(p, type="input_audio_buffer.commit")
    [job] = [e for e in effects if isinstance(e, Transcribe)]
    item_id = sent(effects)[0]["item_id"]
    assert (job.item_id, job.model) == (item_id, "whisper-1")
    assert abs(len(job.pcm) - 3200) <= 16  # 200 ms at 16 kHz
    done = sent(p.on_transcript(item_id, "hello there", None, 0.2))
    assert [e["type"] for e in done] == ["conversation.item.input_audio_transcription.delta",
                                         "conversation.item.input_audio_transcription.completed"]
    assert done[1]["transcript"] == "hello there" and done[1]["content_index"] == 0
    [retrieved] = sent(send(p, type="conversation.item.retrieve", item_id=item_id))
    assert retrieved["item"]["content"][0]["transcript"] == "hello there"
    failed = sent(p.on_transcript(item_id, None, "the recogniser failed", 0.2))
    assert failed[0]["type"] == "conversation.item.input_audio_transcription.failed"


def test_a_users_transcript_comes_back_after_a_resume():
    p = make()
    send(p, type="session.update", session={"audio": {"input": {
        "turn_detection": None, "transcription": {"model": "whisper-1"}}}})
    send(p, type="input_audio_buffer.append", audio=base64.b64encode(bytes(2 * 4800)).decode())
    item_id = sent(send(p, type="input_audio_buffer.commit"))[0]["item_id"]
    p.on_transcript(item_id, "hello there", None, 0.2)
    items, config = p.snapshot(0)

    q = make()
    q.resumed("sess_old", items, config)
    [retrieved] = sent(send(q, type="conversation.item.retrieve", item_id=item_id))
    assert retrieved["item"]["role"] == "user"
    assert retrieved["item"]["content"][0]["transcript"] == "hello there"


def test_any_transcription_model_name_is_taken_and_echoed():
    """No client's choice of name fails its session: one the server does not know selects
    its configured recogniser, and the session says what the client asked for."""
    p = make()
    [updated] = sent(send(p, type="session.update", session={"audio": {"input": {
        "transcription": {"model": "/etc"}}}}))
    assert updated["type"] == "session.updated"
    assert updated["session"]["audio"]["input"]["transcription"]["model"] == "/etc"
