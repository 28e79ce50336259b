"""The Realtime protocol core's side of pausing a reply for speech over it
(`turn_detection.min_interruption_ms`) and of `audio.input.noise_reduction`, driven directly."""


import base64
from itertools import pairwise

import numpy as np
import pytest

from duplex.transport.effects import (
    EngineCancel,
    EngineCommit,
    FlushAudio,
    HoldAudio,
    InterruptionJudged,
    PlayAudio,
    ResumeAudio,
)
from duplex.transport.realtime.protocol import Limits, RealtimeProtocol
from duplex.transport.realtime.session_config import DEFAULT_MIN_INTERRUPTION_MS
from tests.transport.test_realtime_client_contract import send, sent, types

SPEECH, QUIET = 0.9, 0.1
CHUNK = 768
"""Clock samples (24 kHz) behind each speech probability (silero's 32 ms)."""


def make(turn_detection: dict | None = None, duplex_events: bool = True) -> RealtimeProtocol:
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000, model_output_rate=24000,
                         limits=Limits(output_lead_ms=200), duplex_events=duplex_events)
    p.start()
    if turn_detection is not None:
        send(p, type="session.update",
             session={"audio": {"input": {"turn_detection": turn_detection}}})
    return p


def replying(p: RealtimeProtocol) -> int:
    """A user turn (speech, then silence), and 2 s of reply queued in 80 ms frames."""
    effects = p.on_vad([SPEECH] * 10 + [QUIET] * 20)
    epoch = next(e.epoch for e in effects if isinstance(e, EngineCommit))
    for i in range(25):
        p.on_engine_audio(epoch, np.full(1920, 0.1, np.float32), f"w{i} ")
    return epoch


def deltas(effects):
    return [e for e in sent(effects) if e["type"] == "response.output_audio.delta"]


def test_a_cough_pauses_the_reply_and_it_resumes_where_it_stopped():
    p = make({"type": "server_vad", "min_interruption_ms": 300})
    epoch = replying(p)
    assert len(deltas(p.release_output(0))) == 3
    # Speech over the reply: nothing more is sent, and clients are not yet told of speech (a
    # client that hears speech_started stops its own playback).
    effects = p.on_vad([SPEECH] * 4)
    assert types(effects) == ["duplex.output.paused"]
    assert not deltas(p.release_output(24_000))
    # 128 ms of speech, then 200 ms of quiet: a false interruption. The reply goes on with the
    # frame after the last one sent, in the same epoch, and finishes whole.
    effects = p.on_vad([QUIET] * 7)
    assert types(effects) == ["duplex.output.resumed"]
    assert InterruptionJudged(False) in effects
    assert not [e for e in effects if isinstance(e, EngineCancel)]
    more = deltas(p.release_output(24_000))
    assert more and p.core.epoch == epoch
    p.on_engine_finished(epoch)
    rest = [e for now in range(24_000, 5 * 24_000, 480) for e in sent(p.release_output(now))]
    done = [e for e in rest if e["type"] == "response.done"]
    assert done[0]["response"]["status"] == "completed"
    transcript = done[0]["response"]["output"][0]["content"][0]["transcript"]
    assert transcript == "".join(f"w{i} " for i in range(25))
    assert (p.core.interruptions, p.core.false_interruptions) == (0, 1)


def test_on_a_media_track_the_pause_holds_what_the_track_has_a_cough_resumes_it_speech_flushes():
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000, model_output_rate=24000,
                         limits=Limits(output_lead_ms=200), media_track=True)
    p.start()
    send(p, type="session.update", session={"audio": {"input": {"turn_detection": {
        "type": "server_vad", "min_interruption_ms": 300}}}})
    replying(p)
    assert [e for e in p.release_output(0) if isinstance(e, PlayAudio)]
    # The track stops playing what it holds as the reply pauses, not only what would come.
    effects = p.on_vad([SPEECH] * 4)
    assert HoldAudio() in effects and not [e for e in effects if isinstance(e, FlushAudio)]
    effects = p.on_vad([QUIET] * 7)
    assert ResumeAudio() in effects
    # Speech that lasts: held at its onset, then the track's frames are dropped.
    assert HoldAudio() in p.on_vad([SPEECH])
    effects = p.on_vad([SPEECH] * 9)
    assert FlushAudio() in effects and ResumeAudio() not in effects


def test_speech_that_lasts_cancels_the_reply_and_is_announced_from_its_onset():
    p = make({"type": "server_vad", "min_interruption_ms": 300})
    replying(p)
    p.release_output(0)
    onset = p.detector.position
    effects = p.on_vad([SPEECH] * 9)  # 288 ms: not yet
    assert types(effects) == ["duplex.output.paused"]
    effects = p.on_vad([SPEECH])
    names = types(effects)
    assert names[0] == "input_audio_buffer.speech_started"
    started = sent(effects)[0]
    assert started["audio_start_ms"] == max(0, onset - p.detector.prefix_samples) * 1000 // 24000
    assert names.index("input_audio_buffer.speech_started") < names.index("response.done")
    done = next(e for e in sent(effects) if e["type"] == "response.done")
    assert done["response"]["status_details"]["reason"] == "turn_detected"
    assert InterruptionJudged(True) in effects and any(isinstance(e, EngineCancel) for e in effects)
    # The user's turn goes on as any other: its end commits it and starts the next reply.
    effects = p.on_vad([QUIET] * 20)
    assert "input_audio_buffer.speech_stopped" in types(effects)
    assert any(isinstance(e, EngineCommit) for e in effects)


def test_min_interruption_zero_cancels_at_once_and_duplex_events_stay_off_by_default():
    p = make({"type": "server_vad", "min_interruption_ms": 0}, duplex_events=False)
    replying(p)
    p.release_output(0)
    effects = p.on_vad([SPEECH])
    names = types(effects)
    assert names[0] == "input_audio_buffer.speech_started" and "response.done" in names
    p = make({"type": "server_vad"}, duplex_events=False)
    replying(p)
    p.release_output(0)
    assert types(p.on_vad([SPEECH] * 4)) == []
    assert p.core.min_interruption_samples == DEFAULT_MIN_INTERRUPTION_MS * 24


def test_settings_are_echoed_and_bad_values_name_their_field():
    p = make()
    effects = send(p, type="session.update", session={"audio": {"input": {
        "turn_detection": {"type": "server_vad", "min_interruption_ms": 250},
        "noise_reduction": {"type": "far_field"}}}})
    session = sent(effects)[0]["session"]
    assert session["audio"]["input"]["turn_detection"]["min_interruption_ms"] == 250
    assert session["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
    assert p.clock.guard.strength_name == "far_field"
    assert p.core.min_interruption_samples == 250 * 24
    for session, param in (
        ({"audio": {"input": {"noise_reduction": {"type": "speakerphone"}}}},
         "session.audio.input.noise_reduction.type"),
        ({"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                 "min_interruption_ms": -1}}}},
         "session.audio.input.turn_detection.min_interruption_ms"),
    ):
        [error] = sent(send(p, type="session.update", session=session))
        assert error["type"] == "error" and error["error"]["param"] == param
    assert p.clock.guard.strength_name == "far_field"
    send(p, type="session.update", session={"audio": {"input": {"noise_reduction": None}}})
    assert p.clock.guard.strength_name is None


@pytest.mark.parametrize("beta_field, value", [("input_audio_noise_reduction",
                                                {"type": "near_field"})])
def test_beta_spelling_selects_the_guard_too(beta_field, value):
    p = RealtimeProtocol("sess_t", model="echo", model_input_rate=24000, model_output_rate=24000,
                         beta=True)
    p.start()
    send(p, type="session.update", session={beta_field: value})
    assert p.clock.guard.strength_name == "near_field"


def _reply_at(speed: float, cough: bool) -> tuple[np.ndarray, list[int]]:
    """A 2 s reply of a tone at `speed`, released every 20 ms with a 200 ms lead (a cough over
    it 300 ms in, if asked): all the audio the client got, and where each release ended."""
    p = make({"type": "server_vad", "min_interruption_ms": 300})
    send(p, type="session.update", session={"audio": {"output": {"speed": speed}}})
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(1920) / 24000)).astype(np.float32)
    effects = p.on_vad([SPEECH] * 10 + [QUIET] * 20)
    epoch = next(e.epoch for e in effects if isinstance(e, EngineCommit))
    for i in range(25):
        p.on_engine_audio(epoch, tone, f"w{i} ")
    p.on_engine_finished(epoch)
    pcm, ends = [], []
    for now in range(0, 4 * 24_000, 480):
        released = [np.frombuffer(base64.b64decode(e["delta"]), "<i2")
                    for e in deltas(p.release_output(now))]
        if released:
            pcm += released
            ends.append(sum(map(len, pcm)))
        if cough and now == 7200:
            assert types(p.on_vad([SPEECH] * 4)) == ["duplex.output.paused"]
        if cough and now == 12_000:
            assert types(p.on_vad([QUIET] * 7)) == ["duplex.output.resumed"]
    return np.concatenate(pcm), ends


def test_at_another_speed_the_reply_goes_out_in_whole_frames_and_a_cough_loses_nothing():
    """The tempo comes before the pacing: frames, the lead and the pause count the listener's
    time, whatever length the chunks come out at."""
    heard, ends = _reply_at(1.5, cough=False)
    assert len(heard) == pytest.approx(2 * 24_000 / 1.5, rel=0.05)
    # Every release ends on the 20 ms grid (but the reply's last), the first at the lead, and
    # then a frame at a time.
    assert all(end % 480 == 0 for end in ends[:-1])
    assert ends[0] == 4800 and all(b - a == 480 for a, b in pairwise(ends[:-1]))
    coughed, _ = _reply_at(1.5, cough=True)
    assert np.array_equal(coughed, heard)
