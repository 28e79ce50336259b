"""The Twilio Media Streams core driven with plain calls: bad input, accounting, marks and the
playback watermark, barge-in, DTMF, and the TwiML that points a call at the stream."""

import base64
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from duplex.bench.playout import Playout
from duplex.config import Settings
from duplex.media import float_to_g711, ulaw_decode, ulaw_encode
from duplex.transport.effects import (
    CloseConnection,
    EngineCancel,
    EngineCommit,
    EnginePush,
    InterruptionJudged,
    Send,
    VadFeed,
)
from duplex.transport.twilio.protocol import (
    FRAME,
    MULAW_SILENCE,
    REJECT_REASONS,
    BargedIn,
    DtmfReceived,
    Options,
    Rejected,
    TwilioProtocol,
)
from duplex.transport.twilio.twiml import stream_url, twiml, twiml_endpoint

SID = "MZ0123456789abcdef"
SPEECH, QUIET = 0.9, 0.1
SILENCE_PROBS = 16  # 16 x 256 samples > 500 ms at 8 kHz ends a turn
VAD_CHUNK_8K = 256


class Peer:
    """Builds Twilio's messages, numbering them as Twilio does."""

    def __init__(self, p: TwilioProtocol) -> None:
        self.p = p
        self.seq = 0
        self.chunk = 0

    def send(self, event: str, *, seq: int | None = None, sid: str = SID, **fields):
        if seq is None:
            self.seq += 1
            seq = self.seq
        return self.p.receive_text(json.dumps(
            {"event": event, "sequenceNumber": str(seq), "streamSid": sid, **fields}))

    def connected(self):
        return self.p.receive_text(json.dumps(
            {"event": "connected", "protocol": "Call", "version": "1.0.0"}))

    def start(self, encoding="audio/x-mulaw", rate=8000):
        return self.send("start", start={
            "streamSid": SID, "accountSid": "AC1", "callSid": "CA1", "tracks": ["inbound"],
            "customParameters": {"who": "test"},
            "mediaFormat": {"encoding": encoding, "sampleRate": rate, "channels": 1},
        })

    def media(self, payload: bytes = bytes([0xFF]) * FRAME, track="inbound", **kw):
        self.chunk += 1
        return self.send("media", media={
            "track": track, "chunk": str(self.chunk), "timestamp": str(20 * (self.chunk - 1)),
            "payload": base64.b64encode(payload).decode(),
        }, **kw)

    def mark(self, name: str, **kw):
        return self.send("mark", mark={"name": name}, **kw)

    def dtmf(self, digit: str):
        return self.send("dtmf", dtmf={"track": "inbound_track", "digit": digit})


def make(**options) -> tuple[TwilioProtocol, Peer]:
    p = TwilioProtocol("call_t", model_input_rate=8000, model_output_rate=8000,
                       options=Options(**options))
    return p, Peer(p)


def started(**options) -> tuple[TwilioProtocol, Peer]:
    p, peer = make(**options)
    peer.connected()
    assert not rejections(peer.start())
    return p, peer


def rejections(effects) -> list[str]:
    return [e.reason for e in effects if isinstance(e, Rejected)]


def sent(effects) -> list[dict]:
    return [e.event for e in effects if isinstance(e, Send)]


def in_reply(p: TwilioProtocol, peer: Peer) -> int:
    """Speak, fall silent, and return the epoch of the reply that starts."""
    peer.media()
    # Speech with no reply playing is a turn, not a barge-in.
    assert not [e for e in p.on_vad([SPEECH] * 4) if isinstance(e, BargedIn)]
    effects = p.on_vad([QUIET] * SILENCE_PROBS)
    return next(e.epoch for e in effects if isinstance(e, EngineCommit))


@pytest.mark.parametrize(
    "send, reason",
    [
        (lambda peer: peer.p.receive_text("not json"), "invalid_json"),
        (lambda peer: peer.p.receive_text("[1, 2]"), "invalid_json"),
        (lambda peer: peer.p.receive_bytes(b"\x00\x01"), "binary_frame"),
        (lambda peer: peer.p.receive_text('{"event": "bogus"}'), "unknown_event"),
        (lambda peer: peer.p.receive_text('{"no_event": 1}'), "unknown_event"),
        (lambda peer: peer.send("media", media={"track": "inbound", "chunk": "1",
                                                "timestamp": "0"}), "malformed"),
        (lambda peer: peer.p.receive_text(json.dumps(
            {"event": "media", "sequenceNumber": 9, "streamSid": SID, "media": {
                "track": "inbound", "chunk": "1", "timestamp": "0", "payload": ""}})), "malformed"),
        (lambda peer: peer.send("media", media={"track": "inbound", "chunk": "1",
                                                "timestamp": "0", "payload": "***"}), "bad_base64"),
        (lambda peer: peer.media(seq=1), "out_of_order"),
        (lambda peer: peer.media(sid="MZother"), "wrong_stream"),
        (lambda peer: peer.media(track="outbound"), "wrong_track"),
        (lambda peer: peer.mark("duplex.r0.e0.s0"), "unknown_mark"),
        (lambda peer: peer.start(), "duplicate_start"),
        (lambda peer: peer.dtmf("x"), "malformed"),
    ],
)
def test_bad_input_is_rejected_with_a_reason_and_the_call_goes_on(send, reason):
    p, peer = started()
    effects = send(peer)
    assert rejections(effects) == [reason] and reason in REJECT_REASONS
    assert not sent(effects) and not [e for e in effects if isinstance(e, EnginePush)]
    assert p.rejected == {reason: 1}
    effects = peer.media()
    assert not rejections(effects)
    # Taken: the speech detector hears it (the model hears a turn from its speech onset).
    assert [type(e) for e in effects] == [VadFeed]


def test_nothing_but_connected_is_taken_before_a_supported_start():
    p, peer = make()
    peer.connected()
    assert rejections(peer.media()) == ["before_start"]
    assert rejections(peer.mark("duplex.r0.e0.s0")) == ["before_start"]
    assert rejections(peer.dtmf("1")) == ["before_start"]
    assert rejections(peer.start(encoding="audio/x-alaw")) == ["unsupported_format"]
    assert rejections(peer.start(rate=16000)) == ["unsupported_format"]
    assert rejections(peer.media()) == ["before_start"]
    # Sequence numbers count from the start that is taken, whatever came before it.
    peer.seq = 0
    assert not rejections(peer.start())
    assert not rejections(peer.media())


def test_every_inbound_sample_is_accounted_for():
    p, peer = make()
    peer.media()  # before start
    peer.start()
    for _ in range(10):
        peer.media()
    peer.media(seq=5)
    peer.media(track="outbound", payload=bytes(80))
    peer.send("media", media={"track": "inbound", "chunk": "1", "timestamp": "0", "payload": "%%"})
    summary = p.close()
    assert summary["input"] == {
        "received": 12 * FRAME + 80,
        "consumed": 10 * FRAME,
        "buffered": 0,
        "dropped": {"before_start": FRAME, "out_of_order": FRAME, "wrong_track": 80},
    }
    assert summary["rejected"] == {"before_start": 1, "out_of_order": 1, "wrong_track": 1,
                                   "bad_base64": 1}


def test_media_feeds_the_engine_at_its_rate_and_the_vad_at_16k_without_delay():
    p = TwilioProtocol("call_t", model_input_rate=24000, model_output_rate=24000)
    peer = Peer(p)
    peer.start()
    tone = (np.sin(np.arange(FRAME) / 8000 * 2 * np.pi * 400) * 0.5 * 32768).astype(np.int16)
    vad = []
    for _ in range(5):
        effects = peer.media(ulaw_encode(tone))
        vad.append(len(next(e for e in effects if isinstance(e, VadFeed)).pcm))
    # Speech decisions see each 20 ms frame as it arrives (a few samples of filter delay).
    assert vad[0] >= 2 * FRAME - 8 and vad[1:] == [2 * FRAME] * 4


def test_end_of_speech_starts_a_reply_sent_in_paced_20ms_frames_each_piece_then_a_mark():
    p, peer = started(output_lead_ms=200)
    epoch = in_reply(p, peer)
    for i in range(10):  # 80 ms chunks
        p.on_engine_audio(epoch, np.full(640, 0.25, np.float32), f"w{i} ")
    events = sent(p.release_output(0))
    # 200 ms of lead, in whole frames: the chunks starting at 0 and 80 ms, and the first
    # 40 ms of the one at 160 ms (not all of it: the phone holds no more than the lead).
    assert [e["event"] for e in events] == (["media"] * 4 + ["mark"]) * 2 + ["media"] * 2 + ["mark"]
    assert all(e["streamSid"] == SID for e in events)
    payloads = [base64.b64decode(e["media"]["payload"]) for e in events if e["event"] == "media"]
    assert {len(x) for x in payloads} == {FRAME}
    assert abs(ulaw_decode(payloads[0]).astype(float).mean() / 32768 - 0.25) < 0.01
    marks = [e["mark"]["name"] for e in events if e["event"] == "mark"]
    assert marks == [f"duplex.r0.e{epoch}.m{i}" for i in range(3)]
    assert not sent(p.release_output(0))
    # 80 ms on: the rest of that chunk, and the next up to the lead.
    assert [e["event"] for e in sent(p.release_output(640))] == (["media"] * 2 + ["mark"]) * 2
    # Only Twilio's echoes move the watermark, however far the clock has run.
    assert p.core.played_samples == 0
    peer.mark(marks[0])
    assert p.core.played_samples == 640
    peer.mark(marks[1])
    assert p.core.played_samples == 1280


def test_barge_in_clears_cancels_and_keeps_the_transcript_up_to_the_last_echoed_mark():
    p, peer = started(output_lead_ms=200, min_interruption_ms=0)
    epoch = in_reply(p, peer)
    for i in range(10):
        p.on_engine_audio(epoch, np.full(640, 0.25, np.float32), f"w{i} ")
    events = sent(p.release_output(0)) + sent(p.release_output(640))
    marks = [e["mark"]["name"] for e in events if e["event"] == "mark"]
    assert len(marks) == 5
    peer.mark(marks[0])
    peer.mark(marks[1])

    onset = p.clock.detector.position
    effects = p.on_vad([SPEECH])
    assert [e for e in effects if isinstance(e, EngineCancel)] == [EngineCancel(epoch + 1)]
    assert sent(effects) == [{"event": "clear", "streamSid": SID}]
    # Counted as a barge-in, after the clear, from where the speech began.
    assert effects[-1] == BargedIn(onset)
    assert not p.pacer
    [reply] = p.responses()
    assert reply["status"] == "cancelled"
    assert (reply["heard_samples"], reply["transcript"]) == (1280, "w0 w1 ")

    # Twilio echoes the marks the clear dropped: expected, and nothing moves.
    assert not rejections(peer.mark(marks[2]) + peer.mark(marks[3]) + peer.mark(marks[4]))
    assert p.core.played_samples == 1280 and p.responses()[0]["transcript"] == "w0 w1 "
    assert rejections(peer.mark(marks[3])) == ["unknown_mark"]
    # The cancelled reply's late audio never goes out.
    p.on_engine_audio(epoch, np.full(640, 0.25, np.float32), "late ")
    p.on_engine_finished(epoch)
    assert not sent(p.release_output(80_000))

    # The next turn's reply starts where the caller stopped hearing, in the new epoch.
    effects = p.on_vad([QUIET] * SILENCE_PROBS)
    new_epoch = next(e.epoch for e in effects if isinstance(e, EngineCommit))
    assert new_epoch == epoch + 1
    p.on_engine_audio(new_epoch, np.zeros(640, np.float32), "again ")
    events = sent(p.release_output(80_000))
    assert events[-1]["mark"]["name"] == f"duplex.r1.e{new_epoch}.m5"
    peer.mark(events[-1]["mark"]["name"])
    assert p.core.played_samples == 1280 + 640


def test_the_last_frame_is_padded_and_speech_over_the_unplayed_tail_still_clears():
    p, peer = started(min_interruption_ms=0)
    epoch = in_reply(p, peer)
    p.on_engine_audio(epoch, np.full(700, 0.25, np.float32), "all ")
    p.on_engine_finished(epoch)
    events = sent(p.release_output(0))
    payloads = [base64.b64decode(e["media"]["payload"]) for e in events if e["event"] == "media"]
    assert len(payloads) == 5 and payloads[-1][60:] == bytes([MULAW_SILENCE]) * 100
    assert p.responses()[0]["status"] == "completed" and p.reply is None
    # Generated and sent, but Twilio has played none of it: speech now is still a barge-in.
    effects = p.on_vad([SPEECH])
    assert sent(effects) == [{"event": "clear", "streamSid": SID}]
    assert p.responses()[0] == {"id": 0, "epoch": epoch, "status": "cancelled",
                                "sent_samples": 0, "heard_samples": 0, "transcript": ""}


def media_sent(events) -> bytes:
    return b"".join(base64.b64decode(e["media"]["payload"]) for e in events if e["event"] == "media")


def test_speech_over_a_reply_clears_at_once_a_cough_resends_from_the_playhead_and_a_sentence_cuts():
    p, peer = started(output_lead_ms=200, min_interruption_ms=400, resume_gap_ms=200)
    epoch = in_reply(p, peer)
    reply = np.sin(np.arange(6400) * 0.01).astype(np.float32) * 0.5
    for i in range(10):
        p.on_engine_audio(epoch, reply[640 * i : 640 * (i + 1)], f"w{i} ")
    wire = float_to_g711(reply, "ulaw")
    first = sent(p.release_output(0))
    assert media_sent(first) == wire[:1600]
    marks = [e["mark"]["name"] for e in first if e["event"] == "mark"]
    # Twilio echoes the first mark as its playback reaches it, 80 ms in.
    peer.mark(marks[0])
    more = sent(p.release_output(640))
    assert media_sent(more) == wire[1600:2240]
    marks += [e["mark"]["name"] for e in more if e["event"] == "mark"]

    # A cough 10 ms later: the reply pauses and Twilio's buffer is cleared at once.
    effects = p.on_vad([SPEECH])
    assert sent(effects) == [{"event": "clear", "streamSid": SID}]
    assert not [e for e in effects if isinstance(e, EngineCancel)]
    assert not sent(p.release_output(720))
    # Twilio echoes the marks the clear dropped: expected, and they move nothing.
    assert not rejections([e for m in marks[1:] for e in peer.mark(m)])
    assert p.core.played_samples == 640
    assert not sent(p.release_output(8000))
    # Quiet after it until 400 ms from its onset: a false interruption. The reply goes on,
    # in the same epoch, from where the caller's playback stood when the clear went (the
    # echo at 640 and 10 ms of playback since): nothing lost, nothing twice.
    assert not p.on_vad([QUIET] * 11)
    effects = p.on_vad([QUIET])
    assert [e for e in effects if isinstance(e, InterruptionJudged)] == [InterruptionJudged(False)]
    assert not [e for e in effects if isinstance(e, Send)]
    resumed = sent(p.release_output(8000))
    assert media_sent(resumed) == wire[720:2400]
    # In frames on the output's 20 ms grid, the first short.
    sizes = [len(base64.b64decode(e["media"]["payload"])) for e in resumed if e["event"] == "media"]
    assert sizes == [80] + [FRAME] * 10
    assert p.core.epoch == epoch and p.core.false_interruptions == 1

    # Speech that lasts 400 ms cuts the reply: paused and cleared at its onset, cancelled
    # once it has lasted, with no second clear (nothing was sent since the first).
    effects = p.on_vad([SPEECH])
    assert sent(effects) == [{"event": "clear", "streamSid": SID}]
    effects = p.on_vad([SPEECH] * (400 * 8 // VAD_CHUNK_8K - 1))
    assert not [e for e in effects if isinstance(e, EngineCancel)]
    effects = p.on_vad([SPEECH])
    assert [e for e in effects if isinstance(e, EngineCancel)] == [EngineCancel(epoch + 1)]
    assert not sent(effects)
    assert InterruptionJudged(True) in effects and BargedIn in map(type, effects)
    assert p.responses()[0]["status"] == "cancelled"
    assert p.responses()[0]["transcript"] == "w0 "
    assert (p.core.interruptions, p.core.false_interruptions) == (1, 1)


def test_dtmf_reaches_the_session_and_the_end_call_digit_hangs_up_normally():
    p, peer = started(end_call_digit="#")
    assert peer.dtmf("5") == [DtmfReceived("5")]
    effects = peer.dtmf("#")
    assert effects[0] == DtmfReceived("#") and effects[-1] == CloseConnection(1000, "end_call_digit")
    assert peer.media() == []
    assert p.close()["dtmf"] == "5#"


def test_stop_ends_the_call_normally_and_the_books_balance():
    p, peer = started()
    for _ in range(3):
        peer.media()
    effects = peer.send("stop", stop={"accountSid": "AC1", "callSid": "CA1"})
    assert effects[-1] == CloseConnection(1000, "stop")
    summary = p.close()
    assert (summary["call_sid"], summary["stream_sid"]) == ("CA1", SID)
    assert summary["input"]["received"] == summary["input"]["consumed"] == 3 * FRAME
    assert summary["released"]["output:unplayed_samples"] == 0


messages = st.fixed_dictionaries(
    {"event": st.sampled_from(["connected", "start", "media", "dtmf", "mark", "stop", "x"])},
    optional={
        "sequenceNumber": st.one_of(st.integers(0, 9).map(str), st.integers(0, 9)),
        "streamSid": st.sampled_from([SID, "MZx"]),
        "media": st.fixed_dictionaries({"track": st.sampled_from(["inbound", "outbound"]),
                                        "chunk": st.just("1"), "timestamp": st.just("0"),
                                        "payload": st.sampled_from(["/w==", "***", "", "AAAA"])}),
        "mark": st.fixed_dictionaries({"name": st.sampled_from(["duplex.r0.e0.s0", "x"])}),
        "dtmf": st.fixed_dictionaries({"track": st.just("inbound_track"),
                                       "digit": st.sampled_from(["1", "#", "z"])}),
        "start": st.just({"streamSid": SID, "accountSid": "A", "callSid": "C", "tracks": [],
                          "customParameters": {}, "mediaFormat": {
                              "encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}),
        "stop": st.just({"accountSid": "A", "callSid": "C"}),
    },
).map(json.dumps)


turns = st.lists(st.sampled_from([[SPEECH] * 4, [QUIET] * SILENCE_PROBS, [0.5]]), max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(messages, st.text(max_size=20)), turns), max_size=15))
def test_fuzzed_streams_never_crash_and_every_sample_is_accounted_for(steps):
    p, _ = make(end_call_digit="#")
    for now, (frame, vad) in enumerate(steps):
        effects = p.receive_text(frame)
        for probs in vad:
            effects += p.on_vad(probs)
        if p.reply is not None:
            p.on_engine_audio(p.reply.epoch, np.zeros(500, np.float32), "x ")
        effects += p.release_output(now * FRAME)
        for effect in effects:
            if isinstance(effect, Send):
                json.dumps(effect.event)
    assert set(p.rejected) <= set(REJECT_REASONS)
    track = p.close()["input"]
    assert track["received"] == track["consumed"] + sum(track["dropped"].values())


@pytest.mark.parametrize(
    "public_url, host, url",
    [
        ("", "voice.example.com", "wss://voice.example.com/telephony/twilio"),
        ("", "127.0.0.1:8080", "wss://127.0.0.1:8080/telephony/twilio"),
        ("https://voice.example.com/duplex/", "x", "wss://voice.example.com/duplex/telephony/twilio"),
        ("http://127.0.0.1:9000", "x", "ws://127.0.0.1:9000/telephony/twilio"),
        ("wss://edge.example.com", "x", "wss://edge.example.com/telephony/twilio"),
    ],
)
def test_the_stream_url_comes_from_public_url_or_the_host(public_url, host, url):
    assert stream_url(public_url, host) == url


def test_twiml_connects_the_call_to_the_stream():
    app = Starlette(routes=[Route("/telephony/twilio/twiml", twiml_endpoint(""), methods=["POST"])])
    response = TestClient(app).post("/telephony/twilio/twiml", headers={"Host": "pbx.example.com"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/xml")
    assert response.text.endswith('<Response><Connect><Stream url="wss://pbx.example.com/'
                                  'telephony/twilio"/></Connect></Response>')
    assert 'url="wss://a.example/?x=1&amp;y=2"' in twiml("wss://a.example/?x=1&y=2")


@pytest.mark.parametrize("section", [{"end_call_digit": "x"}, {"end_call_digit": "12"},
                                     {"public_url": "voice.example.com"}])
def test_bad_telephony_settings_are_refused(section):
    with pytest.raises(ValidationError):
        Settings.model_validate({"telephony": section})


class Phone:
    """Twilio and the caller's phone on one simulated clock: what the bridge sends plays in
    real time (duplex.bench.playout), each mark comes back the moment playback reaches it, and
    a clear empties the buffer at once and gives back the marks it dropped."""

    def __init__(self, p: TwilioProtocol, peer: Peer) -> None:
        self.p, self.peer = p, peer
        self.playout = Playout()

    def carry(self, now: int, effects) -> None:
        for event in sent(effects):
            if event["event"] == "media":
                pcm = ulaw_decode(base64.b64decode(event["media"]["payload"])) / 32768
                self.playout.push(now, pcm.astype(np.float32), "reply")
            elif event["event"] == "mark":
                self.playout.mark(now, event["mark"]["name"])
            elif event["event"] == "clear":
                for name in self.playout.clear(now):
                    self.peer.mark(name)

    def run(self, start: int, end: int, vad: dict[int, list[float]]) -> None:
        """From `start` to `end`: the session loop's 20 ms ticks, the marks' echoes at their
        own times, and the speech probabilities `vad` holds for some ticks."""
        now = start
        while now < end:
            for name in self.playout.reached(now):
                self.peer.mark(name)
            if now in vad:
                self.carry(now, self.p.on_vad(vad[now]))
            self.carry(now, self.p.release_output(now))
            tick = now - now % FRAME + FRAME
            echo = self.playout.next_mark()
            now = echo if echo is not None and now < echo < tick else tick


def test_a_cough_over_a_call_stops_what_the_caller_hears_at_the_pause_and_all_of_it_is_heard_once():
    p, peer = started(output_lead_ms=200, min_interruption_ms=400, resume_gap_ms=200)
    epoch = in_reply(p, peer)
    reply = np.sin(np.arange(8000 * 3) * 0.013).astype(np.float32) * 0.5
    for i in range(0, len(reply), 640):
        p.on_engine_audio(epoch, reply[i : i + 640], "w ")
    p.on_engine_finished(epoch)
    phone = Phone(p, peer)
    # 1 s into the reply, a cough of one VAD chunk, then quiet: judged false 400 ms on.
    cough = 8000 + 37
    phone.run(0, cough, {})
    heard_at = cough - cough % FRAME + FRAME
    vad = {heard_at: [SPEECH]} | {t: [QUIET] for t in range(heard_at + FRAME, 16000, 2 * FRAME)}
    phone.run(cough, 8000 * 5, vad)
    assert p.core.false_interruptions == 1 and len(phone.playout.clears) == 1
    # Stopped the moment the speech was heard (not 400 ms later), resumed after the judgement,
    # and heard whole: every sample once.
    [cleared] = phone.playout.clears
    assert cleared == heard_at
    assert phone.playout.stopped(cough, "reply") == cleared
    wire = ulaw_decode(float_to_g711(reply, "ulaw")) / 32768
    assert np.array_equal(phone.playout.heard("reply"), wire.astype(np.float32))
    [(gap_from, gap_to)] = phone.playout.breaks("reply")
    assert gap_from == cleared and gap_to > cough + 400 * 8
