"""A phone call in native duplex: `duplex serve --model echo` with echo's default mode set to
duplex, called by a simulated Twilio peer. Every model frame reaches the caller, silence
included, in order, and what the caller said comes back once the model frame holding it (80 ms)
is complete."""

import asyncio
import base64
import json

import numpy as np
import pytest
import websockets

from tests.transport.test_twilio_call import FRAME, RATE, SID, decoded, mulaw

FRAME_S = FRAME / RATE


@pytest.mark.slow
async def test_a_duplex_call_streams_every_frame_and_echoes_the_caller_a_frame_later(
        server_process, tmp_path):
    config = tmp_path / "duplex.toml"
    config.write_text('[duplex]\ndefault_mode = { echo = "duplex" }\n')
    server = server_process("--model", "echo", "--config", str(config))
    t = np.arange(RATE * 4 // 5) / RATE
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    caller = np.concatenate([np.zeros(RATE * 2 // 5), tone, np.zeros(RATE * 4 // 5)])
    received: list[bytes] = []
    arrived: list[float] = []
    sent_at: list[float] = []
    async with websockets.connect(server.url.replace("http", "ws") + "/telephony/twilio",
                                  compression=None) as ws:
        seq = 0

        async def send(message: dict) -> None:
            nonlocal seq
            seq += 1
            await ws.send(json.dumps({"sequenceNumber": str(seq), "streamSid": SID, **message}))

        async def read() -> None:
            async for raw in ws:
                message = json.loads(raw)
                if message["event"] == "media":
                    received.append(base64.b64decode(message["media"]["payload"]))
                    arrived.append(asyncio.get_running_loop().time())
                elif message["event"] == "mark":
                    # Played at once: the watermark follows the reply.
                    await send({"event": "mark", "mark": message["mark"]})

        reader = asyncio.create_task(read())
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await send({"event": "start", "start": {
            "streamSid": SID, "accountSid": "AC0", "callSid": "CA0", "tracks": ["inbound"],
            "customParameters": {}, "mediaFormat": {"encoding": "audio/x-mulaw",
                                                    "sampleRate": 8000, "channels": 1}}})
        start = asyncio.get_running_loop().time()
        for k in range(len(caller) // FRAME):
            await asyncio.sleep(max(0.0, start + k * FRAME_S - asyncio.get_running_loop().time()))
            sent_at.append(asyncio.get_running_loop().time())
            await send({"event": "media", "media": {
                "track": "inbound", "chunk": str(k + 1), "timestamp": str(k * 20),
                "payload": base64.b64encode(mulaw(caller[k * FRAME : (k + 1) * FRAME])).decode()}})
        await asyncio.sleep(0.6)
        await send({"event": "stop", "stop": {"accountSid": "AC0", "callSid": "CA0"}})
        await asyncio.wait_for(reader, 10)
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
    first_sent = sent_at[said[0] // FRAME]
    first_back = arrived[loud[0] // FRAME]
    assert 0.06 <= first_back - first_sent < 0.5, first_back - first_sent
