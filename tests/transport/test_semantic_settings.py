"""What semantic_vad's settings make of the turn detector, on a server with the end-of-turn
model and without it."""

import json

import pytest

from duplex.transport.realtime.protocol import RealtimeProtocol
from duplex.transport.twilio.protocol import Options, TwilioProtocol


def realtime(turn_model: bool) -> RealtimeProtocol:
    return RealtimeProtocol("s", model="m", model_input_rate=24000, model_output_rate=24000,
                            turn_model=turn_model)


def ask_for(p: RealtimeProtocol, **td) -> None:
    p.receive_text(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": td}}}}))


@pytest.mark.parametrize("eagerness, wait_s", [("low", 8), ("medium", 4), ("auto", 4),
                                                ("high", 2)])
def test_with_the_model_eagerness_is_the_longest_wait(eagerness, wait_s):
    p = realtime(turn_model=True)
    ask_for(p, type="semantic_vad", eagerness=eagerness)
    d = p.detector
    assert (d.silence_samples, d.pause_samples, d.ask_samples) == (wait_s * 24000, 4800, 2400)


def test_the_realtime_default_stays_server_vad_and_without_the_model_semantic_is_silence():
    p = realtime(turn_model=True)
    assert p.turn_detection.type == "server_vad" and p.detector.pause_samples is None
    p = realtime(turn_model=False)
    ask_for(p, type="semantic_vad", eagerness="high")
    assert p.detector.pause_samples is None and p.detector.silence_samples == 300 * 24


def test_twilio_calls_are_semantic_by_default_where_the_model_is():
    with_model = TwilioProtocol("c", model_input_rate=8000, model_output_rate=8000,
                                options=Options(turn_model=True)).clock.detector
    assert (with_model.silence_samples, with_model.pause_samples) == (4 * 8000, 1600)
    assert with_model.prefix_samples == 300 * 8
    without = TwilioProtocol("c", model_input_rate=8000, model_output_rate=8000,
                             options=Options()).clock.detector
    assert without.pause_samples is None and without.silence_samples == 500 * 8
    with pytest.raises(ValueError, match="eagerness"):
        Options(eagerness="eager")
