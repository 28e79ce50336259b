"""Calls in native duplex, with `duplex serve --model echo` and echo's default mode set to duplex.

A simulated Twilio peer gets every model frame, silence included, in order, and hears what it
said once the model frame holding it (80 ms) is complete. An aiortc caller hears itself while
it still speaks, and nothing interrupts.
"""

import time

import numpy as np
import pytest
import websockets

from tests.transport.test_twilio_call import FRAME, RATE, SID, Peer, decoded
from tests.waiting import eventually


@pytest.mark.slow
async def test_a_duplex_call_streams_every_frame_and_echoes_the_caller_a_frame_later(
        server_process, tmp_path):
    config = tmp_path / "duplex.toml"
    config.write_text('[duplex]\ndefault_mode = { echo = "duplex" }\n')
    server = server_process("--model", "echo", "--config", str(config))
    t = np.arange(RATE * 4 // 5) / RATE
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    caller = np.concatenate([np.zeros(RATE * 2 // 5), tone, np.zeros(RATE * 4 // 5)])
    async with websockets.connect(server.url.replace("http", "ws") + "/telephony/twilio",
                                  compression=None) as ws:
        peer = Peer(ws)
        peer.start()
        peer.put({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        peer.put({"event": "start", "sequenceNumber": "1", "streamSid": SID, "start": {
            "streamSid": SID, "accountSid": "AC0", "callSid": "CA0", "tracks": ["inbound"],
            "customParameters": {}, "mediaFormat": {"encoding": "audio/x-mulaw",
                                                    "sampleRate": 8000, "channels": 1}}})
        peer.seq = 1
        peer.next_frame_at = time.time()
        await peer.speak(caller)
        # The call's audio has come back before it is stopped, but the model's last frames: they
        # wait for input that never comes.
        await eventually(lambda: len(peer.media_in) * FRAME >= len(caller) - 3 * 1920 // 3,
                         "the caller's audio comes back", 10.0)
        await peer.hang_up({"event": "stop", "streamSid": SID,
                            "stop": {"accountSid": "AC0", "callSid": "CA0"}}, 10)
    received = [payload for _, payload in peer.media_in]
    heard = decoded(b"".join(received))
    # Silence went out too: the caller got (nearly) a whole call's worth of audio, not just
    # the tone. The last frame or two can still be on their way when the call stops.
    assert len(heard) >= len(caller) - 3 * 1920 // 3
    loud = np.flatnonzero(np.abs(heard) > 0.25)
    said = np.flatnonzero(np.abs(caller) > 0.25)
    # Echo's output is its input a frame later, and the call's output stream starts with the
    # model's first frame: sample for sample the caller hears what it said, in place (give or
    # take the resamplers' few samples).
    assert abs(loud[0] - said[0]) < 16 and abs(loud[-1] - said[-1]) < 16
    assert np.abs(heard[: said[0] - 16]).max() < 0.01
    # In time, the tone's first frame comes back after the model frame holding it is complete
    # (the next three 20 ms frames sent) and well within half a second.
    first_sent = peer.taken[said[0] // FRAME][1]
    first_back = peer.media_in[loud[0] // FRAME][0]
    assert 0.06 <= first_back - first_sent < 0.5, first_back - first_sent


@pytest.mark.timing
@pytest.mark.slow
async def test_a_webrtc_call_in_duplex_hears_itself_while_speaking_and_nothing_interrupts(
        server_process, tmp_path):
    from duplex.bench.synth import babble
    from tests.transport.test_webrtc import RATE as RTC_RATE
    from tests.transport.test_webrtc import Caller, best_correlation

    config = tmp_path / "duplex.toml"
    config.write_text('[duplex]\ndefault_mode = { echo = "duplex" }\n')
    server = server_process("--model", "echo", "--config", str(config))
    caller = Caller()
    try:
        await caller.connect(server.url)
        created = await caller.wait_for("session.created")
        assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "duplex"
        speech = np.clip(babble(RTC_RATE * 2, rate=RTC_RATE, seed=31), -1, 1)
        caller.mic.say(np.concatenate([np.zeros(RTC_RATE // 2), speech]))
        # The model (echo) speaks while the caller still does: overlap is the model's business.
        await caller.wait_for("output_audio_buffer.started", timeout=30)
        started_at = caller.events[caller.types().index("output_audio_buffer.started")][0]
        await caller.wait_for("input_audio_buffer.speech_started", timeout=30)
        done = await caller.wait_for("response.done", timeout=30)
        done_at = caller.events[caller.types().index("response.done")][0]
        assert done["response"]["status"] == "completed"
        assert "output_audio_buffer.cleared" not in caller.types()
        # The reply's last frames reach the caller's track before its audio is compared.
        await eventually(lambda: caller.heard and caller.heard[-1][0] >= done_at,
                         "the reply's last audio reaches the caller", 10.0)
        heard = np.concatenate([pcm for t, pcm in caller.heard if t >= started_at - 0.2])
        assert best_correlation(heard, speech[RTC_RATE // 2 : RTC_RATE]) > 0.6
    finally:
        await caller.close()
