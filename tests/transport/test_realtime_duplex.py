"""Native duplex on the Realtime protocol core, driven directly: spoken segments become
responses, silence is never sent, a cancel drops the segment under way for good while the
model keeps going, user speech only informs, and a turn-based model says which models can."""

import base64
import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.media import pcm16_to_float
from duplex.transport.effects import EngineCancel, EngineSetDuplex, Send
from duplex.transport.realtime.duplex_mode import DuplexSegments, SegmentAudio, SegmentStart
from duplex.transport.realtime.protocol import RealtimeProtocol

FRAME = 1920
DUPLEX = {"type": "session.update",
          "session": {"audio": {"input": {"turn_detection": {"type": "duplex",
                                                             "silence_duration_ms": 240}}}}}


def make(native=True):
    p = RealtimeProtocol("sess_d", model="tiny-moshi" if native else "tiny-omni",
                         model_input_rate=24000, model_output_rate=24000, native_duplex=native)
    p.start()
    return p


def sent(effects):
    return [e.event for e in effects if isinstance(e, Send)]


def types(events):
    return [e["type"] for e in events]


def voiced(k):
    return np.full(FRAME, 0.01 * (k % 50 + 1), np.float32)


SILENT = np.zeros(FRAME, np.float32)


class Run:
    """Feeds frames one per 80 ms and releases output at real time, like the session loop."""

    def __init__(self, p):
        self.p, self.now, self.events = p, 0, []

    def frame(self, epoch, pcm, text=""):
        self.events += sent(self.p.on_engine_duplex(epoch, pcm, text, bool(pcm.any())))
        self.now += FRAME
        self.events += sent(self.p.release_output(self.now))

    def idle(self, frames):
        for _ in range(frames):
            self.now += FRAME
            self.events += sent(self.p.release_output(self.now))

    def audio(self):
        chunks = [e["delta"] for e in self.events if e["type"] == "response.output_audio.delta"]
        return np.concatenate([pcm16_to_float(base64.b64decode(c)) for c in chunks])


def test_duplex_on_a_model_that_runs_it_starts_lockstep():
    p = RealtimeProtocol("sess_d", model="tiny-moshi", model_input_rate=24000,
                         model_output_rate=24000, native_duplex=True)
    p.start()
    out = p.receive_text(json.dumps(DUPLEX))
    assert EngineSetDuplex(True) in out
    [updated] = sent(out)
    assert updated["session"]["audio"]["input"]["turn_detection"] == {
        "type": "duplex", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 240}
    # Back to turns in the middle of a spoken segment: it ends, cancelled, and nothing of it
    # follows.
    p.on_engine_duplex(0, voiced(1), "a", True)
    p.release_output(FRAME)
    back = p.receive_text(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}}))
    assert EngineSetDuplex(False) in back
    done = [e for e in sent(back) if e["type"] == "response.done"]
    assert done[0]["response"]["status"] == "cancelled" and p.response is None
    assert sent(p.on_engine_duplex(0, voiced(2), "b", True)) == []


def test_duplex_asked_of_a_turn_based_model_is_an_error_naming_those_that_can():
    p = make(native=False)
    out = p.receive_text(json.dumps(DUPLEX))
    [error] = sent(out)
    assert error["type"] == "error"
    assert error["error"]["code"] == "invalid_value"
    assert error["error"]["param"] == "session.audio.input.turn_detection.type"
    assert "tiny-moshi" in error["error"]["message"] and "tiny-omni" in error["error"]["message"]
    assert not any(isinstance(e, EngineSetDuplex) for e in out)
    # The session goes on, by turns.
    ok = sent(p.receive_text(json.dumps({"type": "session.update",
                                         "session": {"instructions": "hi"}})))
    assert types(ok) == ["session.updated"]
    assert ok[0]["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"


def test_spoken_segments_become_responses_and_silence_is_never_sent():
    p = make()
    p.receive_text(json.dumps(DUPLEX))
    run = Run(p)
    first = [voiced(k) for k in range(5)]
    second = [voiced(k + 10) for k in range(3)]
    for _ in range(4):
        run.frame(0, SILENT)
    assert run.events == []
    for k, pcm in enumerate(first):
        run.frame(0, pcm, f"w{k} ")
    run.frame(0, SILENT)  # a pause shorter than the stretch stays inside the segment
    run.frame(0, first[0])
    for _ in range(6):
        run.frame(0, SILENT)
    for pcm in second:
        run.frame(0, pcm)
    for _ in range(6):
        run.frame(0, SILENT)
    run.idle(10)
    seq = types(run.events)
    assert seq.count("response.created") == 2 and seq.count("response.done") == 2
    done = [e for e in run.events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["completed", "completed"]
    want = np.concatenate([*first, SILENT, first[0], *second])
    np.testing.assert_allclose(run.audio(), want, atol=1 / 32768)
    transcripts = [e["transcript"] for e in run.events
                   if e["type"] == "response.output_audio_transcript.done"]
    assert transcripts == ["w0 w1 w2 w3 w4 ", ""]
    # The second response begins only after the first is done.
    assert seq.index("response.created", seq.index("response.done")) > seq.index("response.done")


def test_a_cancelled_segment_never_reaches_the_client_and_the_model_keeps_going():
    p = make()
    p.receive_text(json.dumps(DUPLEX))
    run = Run(p)
    for k in range(3):
        run.frame(0, voiced(k))
    out = p.receive_text(json.dumps({"type": "response.cancel"}))
    assert EngineCancel(1) in out
    run.events += sent(out)
    cancelled_at = len(run.events)
    assert run.events[-2]["type"] == "response.done"
    assert run.events[-2]["response"]["status"] == "cancelled"
    heard = len(run.audio())
    # Frames of the old epoch still in flight, then the same segment going on in the new one.
    run.frame(0, voiced(3))
    for k in range(4, 8):
        run.frame(1, voiced(k))
    after = run.events[cancelled_at:]
    assert "response.output_audio.delta" not in types(after)
    assert "response.created" not in types(after)
    assert len(run.audio()) == heard
    # Once the model has been quiet for the stretch, its next segment is a new response.
    for _ in range(3):
        run.frame(1, SILENT)
    run.frame(1, voiced(20))
    run.idle(2)
    assert types(run.events[cancelled_at:]).count("response.created") == 1
    np.testing.assert_allclose(run.audio()[heard:], voiced(20), atol=1 / 32768)


def test_user_speech_in_duplex_is_reported_and_interrupts_nothing():
    p = make()
    p.receive_text(json.dumps(DUPLEX))
    run = Run(p)
    for k in range(3):
        run.frame(0, voiced(k))
    vad = p.on_vad([0.99] * 20) + p.on_vad([0.0] * 40)
    events = sent(vad)
    assert "input_audio_buffer.speech_started" in types(events)
    assert "input_audio_buffer.speech_stopped" in types(events)
    assert not any(isinstance(e, EngineCancel) for e in vad)
    assert "response.done" not in types(events) and "input_audio_buffer.committed" not in types(events)
    assert p.response is not None
    refused = sent(p.receive_text(json.dumps({"type": "response.create"})))
    assert refused[0]["type"] == "error"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=60), st.integers(1, 5))
def test_segments_never_send_a_fenced_or_stale_frame(steps, stretch):
    """Whatever the frames and cancels, audio goes out only between a start and an end, never
    in an epoch older than the last cancel, and never from a segment cut by a cancel."""
    seg = DuplexSegments(stretch * FRAME)
    epoch, open_, fenced = 0, False, False
    for voice, cancel in steps:
        if cancel:
            epoch += 1
            fenced = fenced or open_
            open_ = False
            seg.cancel(epoch)
        for stale in (epoch - 1, epoch):
            if stale < 0:
                continue
            for action in seg.frame(stale, voiced(1) if voice else SILENT, "", voice):
                assert stale == epoch
                if isinstance(action, SegmentStart):
                    assert not open_
                    open_ = True
                elif isinstance(action, SegmentAudio):
                    assert open_
                else:
                    assert open_
                    open_ = False
        fenced = fenced and seg.fenced
        assert open_ == seg.speaking


def test_twilio_call_in_duplex_sends_every_frame_silence_included_and_speech_interrupts_nothing():
    from duplex.transport.twilio.protocol import FRAME as TWILIO_FRAME
    from duplex.transport.twilio.protocol import Options, TwilioProtocol
    from tests.transport.test_twilio_protocol import SID, Peer

    p = TwilioProtocol("call_d", model_input_rate=24000, model_output_rate=24000,
                       options=Options(duplex=True))
    peer = Peer(p)
    peer.connected()
    assert EngineSetDuplex(True) in peer.start()
    out, now = [], 0
    frames = [SILENT, voiced(1), voiced(2), SILENT, SILENT, voiced(3)]
    for k, pcm in enumerate(frames):
        out += p.on_engine_duplex(0, pcm, f"t{k}" if pcm.any() else "", bool(pcm.any()))
        out += p.on_vad([0.99] * 4)
        now += 640  # 80 ms at 8 kHz
        out += p.release_output(now)
    out += p.release_output(now + 8000)
    media = [e.event for e in out if isinstance(e, Send) and e.event["event"] == "media"]
    assert all(m["streamSid"] == SID for m in media)
    # Every 80 ms frame goes out as four 20 ms media messages (the resampler keeps a short
    # tail of the last one until more comes).
    assert len(media) * TWILIO_FRAME >= (len(frames) - 1) * 640
    assert not [e for e in out if isinstance(e, Send) and e.event["event"] == "clear"]
    assert not any(isinstance(e, EngineCancel) for e in out)


def test_duplex_refused_for_lack_of_room_leaves_the_session_taking_turns():
    p = make()
    p.receive_text(json.dumps(DUPLEX))
    events = sent(p.duplex_refused("a duplex tick of 9 sessions would take about 95 ms"))
    assert types(events) == ["error", "session.updated"]
    assert events[0]["error"]["code"] == "session_limit_reached"
    assert events[1]["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert p.segments is None
    # A duplex frame still in flight from the engine goes nowhere.
    assert sent(p.on_engine_duplex(0, voiced(1), "x", True)) == []


def test_clients_that_ask_learn_where_each_reply_sits_on_the_input_timeline():
    p = RealtimeProtocol("sess_d", model="echo", model_input_rate=24000, model_output_rate=24000,
                         native_duplex=True, duplex_events=True)
    p.start()
    p.receive_text(json.dumps(DUPLEX))
    # Echo with a one-frame lag: input frame 7 comes back as the output of its own step, which
    # starts where input frame 7 ends.
    events = sent(p.on_engine_duplex(0, voiced(1), "", True, at=8 * FRAME))
    placed = [e for e in events if e["type"] == "duplex.response.placed"]
    assert placed == [{"type": "duplex.response.placed", "event_id": placed[0]["event_id"],
                       "response_id": p.response.id, "audio_start_ms": 8 * 80}]
