"""The Realtime protocol core driven directly: bad input, formats, beta spellings, fuzzing."""

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.media import alaw_encode, ulaw_encode
from duplex.transport.effects import (
    CloseConnection,
    EngineCancel,
    EngineCommit,
    EnginePush,
    Send,
    VadFeed,
)
from duplex.transport.realtime.protocol import Limits, RealtimeProtocol


def make(beta=False, **limits):
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000,
                         model_output_rate=24000, beta=beta, limits=Limits(**limits))
    p.start()
    return p


def sent(effects):
    return [e.event for e in effects if isinstance(e, Send)]


def send(p, **event):
    return p.receive_text(json.dumps(event))


def error_of(effects):
    [event] = sent(effects)
    assert event["type"] == "error"
    return event["error"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    "frame, code, param",
    [
        ("not json", "invalid_json", None),
        ("[1, 2]", "invalid_json", None),
        ('{"no_type": 1}', "missing_required_parameter", "type"),
        ('{"type": "session.delete"}', "invalid_event_type", "type"),
        ('{"type": "input_audio_buffer.append"}', "invalid_value", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": 5}', "invalid_value", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "***"}', "invalid_value", "audio"),
        ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "invalid_value", "audio"),
        ('{"type": "conversation.item.truncate", "item_id": "x", "content_index": 0}',
         "invalid_value", "audio_end_ms"),
        ('{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/mp3"}}}}}',
         "invalid_value", "session.audio.input.format.type"),
        ('{"type": "session.update", "session": {"input_audio_format": "pcm16"}}',
         "unknown_parameter", "session.input_audio_format"),
        ('{"type": "response.cancel"}', "response_cancel_not_active", None),
        ('{"type": "input_audio_buffer.commit"}', "input_audio_buffer_commit_empty", None),
        ('{"type": "conversation.item.delete", "item_id": "nope"}', "item_not_found", "item_id"),
    ],
)
def test_bad_input_gets_an_error_naming_the_problem(frame, code, param):
    p = make()
    err = error_of(p.receive_text(frame))
    assert (err["code"], err["param"]) == (code, param)
    assert err["message"]


def test_error_echoes_the_client_event_id_and_the_session_keeps_working():
    p = make(max_errors=100)
    err = error_of(send(p, type="input_audio_buffer.append", audio="***", event_id="evt_42"))
    assert err["event_id"] == "evt_42"
    effects = send(p, type="input_audio_buffer.append", audio=b64(b"\x00\x00" * 480))
    # Taken: the speech detector hears it (the model hears a turn from its speech onset).
    assert any(isinstance(e, VadFeed) for e in effects)
    assert not sent(effects)


def test_oversized_frames_are_answered_then_closed_1009():
    p = make(max_message_bytes=2048)
    effects = send(p, type="input_audio_buffer.append", audio=b64(bytes(4096)))
    assert error_of(effects[:-1])["code"] == "message_too_large"
    assert effects[-1] == CloseConnection(1009, "message too large")


def test_appends_faster_than_real_time_are_refused_and_counted():
    p = make(max_input_lead_ms=1000)
    one_second = b64(bytes(48000))
    assert not sent(send(p, type="input_audio_buffer.append", audio=one_second))
    err = error_of(send(p, type="input_audio_buffer.append", audio=one_second))
    assert err["code"] == "input_rate_exceeded"
    track = p.core.track("input_audio")
    assert track.dropped == {"faster_than_real_time": 24000}
    p.release_output(24000)
    assert not sent(send(p, type="input_audio_buffer.append", audio=one_second))


def test_abuse_beyond_the_error_limit_closes_1008():
    p = make(max_errors=3)
    for _ in range(3):
        assert not any(isinstance(e, CloseConnection) for e in p.receive_text("x"))
    assert p.receive_text("x")[-1] == CloseConnection(1008, "more than 3 errors")


@pytest.mark.parametrize("fmt, encode", [("audio/pcmu", ulaw_encode), ("audio/pcma", alaw_encode)])
def test_g711_input_is_decoded_onto_the_24k_clock(fmt, encode):
    p = make()
    # Without turn detection the model hears input as it comes (not from a speech onset).
    send(p, type="session.update",
         session={"audio": {"input": {"format": {"type": fmt}, "turn_detection": None}}})
    tone = (np.sin(np.arange(8000) / 8000 * 2 * np.pi * 300) * 8000).astype(np.int16)
    effects = send(p, type="input_audio_buffer.append", audio=b64(encode(tone)))
    pushed = np.concatenate([e.pcm for e in effects if isinstance(e, EnginePush)])
    assert 23000 < len(pushed) <= 24000
    spectrum = np.abs(np.fft.rfft(pushed))
    assert abs(np.argmax(spectrum) * 24000 / len(pushed) - 300) < 5


def test_beta_clients_get_beta_spellings():
    p = make(beta=True)
    updated = sent(send(p, type="session.update",
                        session={"input_audio_format": "g711_ulaw", "turn_detection": None}))[0]
    assert updated["session"]["input_audio_format"] == "g711_ulaw"
    assert updated["session"]["turn_detection"] is None
    send(p, type="input_audio_buffer.append", audio=b64(bytes(8000)))
    types = [e["type"] for e in sent(send(p, type="input_audio_buffer.commit"))]
    assert types == ["input_audio_buffer.committed", "conversation.item.created"]
    effects = send(p, type="response.create")
    epoch = next(e.epoch for e in effects if isinstance(e, EngineCommit))
    p.on_engine_audio(epoch, np.zeros(1920, np.float32), "hi")
    p.on_engine_finished(epoch)
    types = [e["type"] for e in sent(p.release_output(0))]
    assert types[:2] == ["response.audio.delta", "response.audio_transcript.delta"]
    assert "response.audio.done" in types and "response.audio_transcript.done" in types


def test_output_is_paced_with_a_bounded_lead_and_cancel_flushes_it():
    p = make(output_lead_ms=200)
    send(p, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    effects = send(p, type="response.create")
    epoch = next(e.epoch for e in effects if isinstance(e, EngineCommit))
    for _ in range(25):  # 2 s of reply in 80 ms frames
        p.on_engine_audio(epoch, np.zeros(1920, np.float32), "w ")
    deltas = [e for e in sent(p.release_output(0)) if e["type"] == "response.output_audio.delta"]
    # The 200 ms lead: the chunks at 0 and 80 ms, and the first 40 ms of the one at 160 ms.
    assert [len(base64.b64decode(e["delta"])) // 2 for e in deltas] == [1920, 1920, 960]
    deltas = [e for e in sent(p.release_output(4800)) if e["type"] == "response.output_audio.delta"]
    # 200 ms later, up to the lead again: the rest of that chunk, and those at 240 and 320 ms.
    assert [len(base64.b64decode(e["delta"])) // 2 for e in deltas] == [960, 1920, 1920]
    assert p.core.played_samples == 4800
    effects = send(p, type="response.cancel")
    assert any(isinstance(e, EngineCancel) for e in effects)
    types = [e["type"] for e in sent(effects)]
    assert types[-2:] == ["response.done", "output_audio_buffer.cleared"]
    assert not p.pacer
    assert not [e for e in sent(p.release_output(48000)) if "delta" in e["type"]]
    p.on_engine_audio(epoch, np.zeros(1920, np.float32), "late")
    assert not p.pacer


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
event_types = st.sampled_from([
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
    "input_audio_buffer.clear", "output_audio_buffer.clear", "conversation.item.create",
    "conversation.item.truncate", "conversation.item.delete", "conversation.item.retrieve",
    "response.create", "response.cancel", "bogus",
])
events = st.builds(
    lambda t, fields: json.dumps({**fields, "type": t}),
    event_types,
    st.dictionaries(
        st.sampled_from(["session", "audio", "item", "item_id", "content_index", "audio_end_ms",
                         "event_id", "response", "previous_item_id"]),
        json_values, max_size=4,
    ),
)


@pytest.mark.cpu_bound
# Nine tenths of each example is hypothesis drawing the nested JSON: 400 streams of up to 12
# frames cover the event types and fields many times over.
@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(events, st.text(max_size=40)), max_size=12))
def test_fuzzed_event_streams_never_crash_and_answer_only_json_events(frames):
    p = make(max_errors=10_000)
    for frame in frames:
        for effect in p.receive_text(frame):
            if isinstance(effect, Send):
                json.dumps(effect.event)
                assert effect.event["type"] and effect.event["event_id"]
        track = p.core.track("input_audio")
        assert track.received == track.consumed + track.buffered + track.dropped_total


def test_camera_frames_are_sampled_by_timestamp_into_the_engine():
    from duplex.transport.effects import EnginePushFrame

    p = make()
    pushed = []
    for i in range(60):  # 2 s at 30 fps
        pushed += [e for e in p.receive_video_frame(f"frame{i}", i * 800) if isinstance(e, EnginePushFrame)]
    assert [e.frame for e in pushed] == ["frame0", "frame15", "frame30", "frame45"]
    video = p.core.track("video")
    assert (video.received, video.consumed, video.dropped) == (60, 4, {"not_sampled": 56})


def test_text_and_image_items_reach_the_engine_and_bad_images_are_named():
    import av

    from duplex.media.image import decode_image
    from duplex.transport.effects import EnginePushImage, EnginePushText

    p = make()
    effects = send(p, type="conversation.item.create",
                   item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]})
    assert [e for e in effects if isinstance(e, EnginePushText)] == [EnginePushText("hello")]
    assert [e["type"] for e in sent(effects)] == ["conversation.item.added", "conversation.item.done"]

    png = av.CodecContext.create("png", "w")
    png.width, png.height, png.pix_fmt = 8, 6, "rgb24"
    frame = av.VideoFrame.from_ndarray(np.full((6, 8, 3), 200, np.uint8), format="rgb24")
    image_bytes = b"".join(bytes(p) for p in [*png.encode(frame), *png.encode(None)])
    url = "data:image/png;base64," + b64(image_bytes)
    effects = send(p, type="conversation.item.create",
                   item={"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": url}]})
    [image] = [e for e in effects if isinstance(e, EnginePushImage)]
    assert decode_image(image.data).shape == (6, 8, 3)

    err = error_of(send(p, type="conversation.item.create", item={
        "type": "message", "role": "user",
        "content": [{"type": "input_image", "image_url": "https://example.com/cat.png"}]}))
    assert (err["code"], err["param"]) == ("invalid_value", "item.content.0.image_url")
    with pytest.raises(ValueError, match="could not be decoded"):
        decode_image(b"not an image")
