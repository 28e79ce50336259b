"""Every way a connection can end releases its session: the hub entry, the engine's state (bytes
held back to 0), the registry keeper, and for WebRTC the peer connection and its sockets; and
none of them leaves a traceback in the server's log.

Real parts only: `duplex serve --model echo` subprocesses, websockets clients, aiortc peers.
"""

import asyncio
import base64
import contextlib
import fractions
import json
import os
import socket
import struct
import time

import av
import httpx
import numpy as np
import pytest
import websockets
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from duplex.bench.synth import babble
from duplex.media import ulaw_encode
from duplex.transport.webrtc.calls import CONNECT_TIMEOUT_S
from duplex.transport.webrtc.ice import offer_host_addresses
from tests.waiting import eventually

RATE = 24000
SPEECH = (np.clip(babble(RATE, rate=RATE, seed=5), -1, 1) * 32767).astype("<i2")


async def reset(ws) -> None:
    """Drop the connection the way a crashed peer does: a TCP RST, no close frame, no FIN."""
    sock = ws.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def close(ws) -> None:
    await ws.close(1000)


async def until(ws, type_: str, timeout_s: float = 15.0, key: str = "type") -> dict:
    """The next event of `type_`, skipping the others."""
    async with asyncio.timeout(timeout_s):
        while (event := json.loads(await ws.recv()))[key] != type_:
            pass
    return event


async def closed_by_server(ws) -> int:
    """Read to the end (a peer that stops reading never sees the close frame); the close code."""
    with contextlib.suppress(websockets.ConnectionClosed):
        async for _ in ws:
            pass
    return ws.close_code


async def until_held(server, holdings) -> None:
    """Wait until the engine holds bytes for a session, so that a release can be seen."""
    async def held() -> int:
        return (await holdings(server))["bytes_held"]

    await eventually(held, "the engine holds the session's audio")


# -- Realtime WebSocket ---------------------------------------------------------------------


def realtime_url(server) -> str:
    return server.url.replace("http", "ws") + "/v1/realtime"


async def realtime(server):
    ws = await websockets.connect(realtime_url(server), max_size=None, compression=None)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created"
    return ws, created


async def send(ws, **event) -> None:
    await ws.send(json.dumps(event))


async def append_speech(ws, seconds: int = 1) -> None:
    await send(ws, type="session.update",
               session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    await send(ws, type="input_audio_buffer.append",
               audio=base64.b64encode(np.tile(SPEECH, seconds).tobytes()).decode())


async def reply_streaming(ws, seconds: int = 1) -> None:
    """Ask for a reply (the echo of `seconds` of speech) and return at its first audio: the
    server goes on sending it, paced to playback, for as long again."""
    await append_speech(ws, seconds)
    await send(ws, type="input_audio_buffer.commit")
    await send(ws, type="response.create")
    await until(ws, "response.output_audio.delta")


@pytest.mark.slow
async def test_realtime_sessions_are_released_however_the_client_leaves(
        server_process, holdings, wait_released):
    server = server_process("--model", "echo")
    for leave in (close, reset):
        ws, _ = await realtime(server)
        await append_speech(ws)
        await until_held(server, holdings)
        await leave(ws)
        await wait_released(server)

        ws, _ = await realtime(server)
        await reply_streaming(ws)
        await leave(ws)
        await wait_released(server)


@pytest.mark.slow
async def test_realtime_sessions_the_server_ends_are_released(server_process, wait_released):
    server = server_process("--model", "echo",
                            env={**os.environ, "DUPLEX_LIMITS__MAX_SESSION_S": "3"})
    ws, _ = await realtime(server)
    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (3 << 19)}))
    assert (await until(ws, "error"))["error"]["code"] == "message_too_large"
    assert await closed_by_server(ws) == 1009
    await wait_released(server)

    ws, _ = await realtime(server)
    for _ in range(101):
        await ws.send(b"\x00")
    assert await closed_by_server(ws) == 1008
    await wait_released(server)

    # A frame past the server's own limit (4 x max_message_bytes) while a reply streams:
    # uvicorn closes the connection itself, and the session's next send finds it closed.
    ws, _ = await realtime(server)
    await reply_streaming(ws)
    with contextlib.suppress(websockets.ConnectionClosed):  # it may close before all is sent
        await ws.send("x" * ((4 << 20) + 1))
    assert await closed_by_server(ws) == 1009
    await wait_released(server)

    # The duration limit ends a session in the middle of a reply.
    ws, _ = await realtime(server)
    await reply_streaming(ws, seconds=4)
    assert (await until(ws, "error", 10))["error"]["code"] == "session_duration_exceeded"
    assert await closed_by_server(ws) == 1008
    await wait_released(server)


@pytest.mark.slow
async def test_realtime_sessions_are_released_when_the_client_leaves_during_a_resume(
        server_process, wait_released):
    server = server_process("--model", "echo")
    ws, created = await realtime(server)
    session = created["session"]
    resume = {"type": "session.resume", "session_id": session["id"],
              "resume_token": session["resume_token"]}
    await send(ws, type="conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
    await until(ws, "conversation.item.done")
    await ws.close()
    await wait_released(server)

    for leave in (close, reset):
        ws, _ = await realtime(server)
        await ws.send(json.dumps(resume))
        await leave(ws)
        await wait_released(server)

    # The session is live elsewhere when a resume takes it and leaves: the first connection
    # hears at its next save that it no longer serves the session, and ends too.
    first, _ = await realtime(server)
    await first.send(json.dumps(resume))
    await until(first, "session.resumed")
    second, _ = await realtime(server)
    await second.send(json.dumps(resume))
    await until(second, "session.resumed")
    await reset(second)
    assert (await until(first, "error"))["error"]["code"] == "session_taken_over"
    assert await closed_by_server(first) == 4409
    await wait_released(server)

    # Nothing of the interrupted resumes stuck to the session: it still resumes.
    ws, _ = await realtime(server)
    await ws.send(json.dumps(resume))
    resumed = await until(ws, "session.resumed")
    assert resumed["session"]["id"] == session["id"]
    await ws.close()
    await wait_released(server)


# -- Twilio Media Streams -------------------------------------------------------------------

SID = "MZ00000000000000000000000000000001"
START = {"event": "start", "sequenceNumber": "1", "streamSid": SID, "start": {
    "streamSid": SID, "accountSid": "AC0", "callSid": "CA0", "tracks": ["inbound"],
    "customParameters": {},
    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}


class TwilioCall:
    def __init__(self, ws) -> None:
        self.ws = ws
        self.seq = 1

    @classmethod
    async def start(cls, server) -> "TwilioCall":
        url = server.url.replace("http", "ws") + "/telephony/twilio"
        call = cls(await websockets.connect(url, compression=None))
        await call.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await call.ws.send(json.dumps(START))
        return call

    async def send(self, event: str, **body) -> None:
        self.seq += 1
        await self.ws.send(json.dumps({"event": event, "sequenceNumber": str(self.seq),
                                       "streamSid": SID, **body}))

    async def say(self, pcm_8k: np.ndarray) -> None:
        """Faster than real time: the server takes it all and hears the turn end at once."""
        data = ulaw_encode((np.clip(pcm_8k, -1, 1) * 32767).astype(np.int16))
        for i in range(0, len(data), 160):
            await self.send("media", media={"track": "inbound", "chunk": str(self.seq),
                                            "timestamp": str(self.seq * 20),
                                            "payload": base64.b64encode(data[i:i + 160]).decode()})


async def twilio_reply_streaming(call: TwilioCall) -> None:
    # Synthetic speech tells the end-of-turn model nothing: the turn ends at semantic_vad's
    # longest wait (4 s), which the silence outlasts.
    await call.say(np.concatenate([babble(8000, rate=8000, seed=7), np.zeros(5 * 8000)]))
    await until(call.ws, "media", key="event")


@pytest.mark.slow
async def test_twilio_calls_are_released_however_they_end(
        server_process, holdings, wait_released):
    server = server_process("--model", "echo")
    call = await TwilioCall.start(server)
    await call.say(babble(4000, rate=8000, seed=3))
    await until_held(server, holdings)
    await call.send("stop", stop={"accountSid": "AC0", "callSid": "CA0"})
    assert await closed_by_server(call.ws) == 1000
    await wait_released(server)

    for leave in (close, reset):
        call = await TwilioCall.start(server)
        await call.say(babble(4000, rate=8000, seed=3))
        await until_held(server, holdings)
        await leave(call.ws)
        await wait_released(server)

        call = await TwilioCall.start(server)
        await twilio_reply_streaming(call)
        await leave(call.ws)
        await wait_released(server)


# -- WebRTC ---------------------------------------------------------------------------------


class Mic(MediaStreamTrack):
    """48 kHz audio in real time: what was queued with say(), then silence."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.queue = np.zeros(0, np.float32)
        self.pts = 0
        self.t0: float | None = None

    def say(self, audio: np.ndarray) -> None:
        self.queue = np.concatenate([self.queue, audio.astype(np.float32)])

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        self.t0 = self.t0 or time.monotonic()
        await asyncio.sleep(max(0.0, self.t0 + self.pts / 48000 - time.monotonic()))
        chunk = np.zeros(960, np.float32)
        n = min(960, len(self.queue))
        chunk[:n], self.queue = self.queue[:n], self.queue[n:]
        frame = av.AudioFrame.from_ndarray((chunk * 32767).astype(np.int16).reshape(1, -1),
                                           format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, self.pts, fractions.Fraction(1, 48000)
        self.pts += 960
        return frame


class Caller:
    def __init__(self) -> None:
        offer_host_addresses(["127.0.0.1"])
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = Mic()
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: list[dict] = []
        self.channel.on("message", lambda m: self.events.append(json.loads(m)))
        self.location = ""

    async def call(self, server) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        async with httpx.AsyncClient() as client:
            answer = await client.post(f"{server.url}/v1/realtime/calls",
                                       content=self.pc.localDescription.sdp,
                                       headers={"Content-Type": "application/sdp"})
        assert answer.status_code == 201, answer.text
        self.location = answer.headers["location"]
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))

    async def until(self, type_: str, timeout_s: float = 20.0) -> None:
        await eventually(lambda: type_ in [e["type"] for e in self.events],
                         f"{type_} among the call's events", timeout_s)


async def hang_up(server, caller: Caller) -> None:
    async with httpx.AsyncClient() as client:
        assert (await client.post(f"{server.url}{caller.location}/hangup")).status_code == 200


async def close_channel(_server, caller: Caller) -> None:
    caller.channel.close()


async def close_peer(_server, caller: Caller) -> None:
    await caller.pc.close()


async def webrtc_call(server, leave, wait_released, udp: int, reply: bool) -> None:
    caller = Caller()
    try:
        await caller.call(server)
        await caller.until("session.created")
        if reply:
            speech = np.clip(babble(48000, rate=48000, seed=9), -1, 1)
            caller.mic.say(np.concatenate([np.zeros(9600), speech]))
            await caller.until("output_audio_buffer.started", 30)
        await leave(server, caller)
        await wait_released(server, udp)
    finally:
        await caller.pc.close()


async def hung_up_while_connecting(server, wait_released, udp: int) -> None:
    """Hang up while the server's ICE still checks the caller's candidates (the caller never
    takes the answer, so none answers them). Without BUNDLE each section has a transport of its
    own: aiortc's connect, woken when the first closes, may find the next closed too."""
    caller = Caller()
    try:
        await caller.pc.setLocalDescription(await caller.pc.createOffer())
        sdp = "".join(line for line in caller.pc.localDescription.sdp.splitlines(keepends=True)
                      if not line.startswith("a=group:BUNDLE"))
        async with httpx.AsyncClient() as client:
            answer = await client.post(f"{server.url}/v1/realtime/calls", content=sdp,
                                       headers={"Content-Type": "application/sdp"})
            assert answer.status_code == 201, answer.text
            hung = await client.post(f"{server.url}{answer.headers['location']}/hangup")
            assert hung.status_code == 200
        await wait_released(server, udp)
    finally:
        await caller.pc.close()


async def never_connects(server, wait_released, udp: int) -> None:
    """An offer without candidates from a peer that never takes the answer: the server's ICE
    waits for checks from it (as from a browser that posts its offer before gathering), and
    only the connect deadline ends the call."""
    caller = Caller()
    try:
        await caller.pc.setLocalDescription(await caller.pc.createOffer())
        sdp = "".join(line for line in caller.pc.localDescription.sdp.splitlines(keepends=True)
                      if not line.startswith("a=candidate:"))
        async with httpx.AsyncClient() as client:
            answer = await client.post(f"{server.url}/v1/realtime/calls", content=sdp,
                                       headers={"Content-Type": "application/sdp"})
        assert answer.status_code == 201, answer.text
        await wait_released(server, udp, timeout_s=CONNECT_TIMEOUT_S + 10)
    finally:
        await caller.pc.close()


@pytest.mark.slow
async def test_webrtc_calls_are_released_however_they_end(
        server_process, holdings, wait_released):
    server = server_process("--model", "echo")
    udp = (await holdings(server))["udp_sockets"]
    for leave in (hang_up, close_channel, close_peer):
        await webrtc_call(server, leave, wait_released, udp, reply=False)
        # Again while a reply plays: the echo of a second of speech.
        await webrtc_call(server, leave, wait_released, udp, reply=True)
    await hung_up_while_connecting(server, wait_released, udp)
    await never_connects(server, wait_released, udp)
