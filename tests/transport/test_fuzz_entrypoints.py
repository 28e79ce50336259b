"""A seeded fuzz of the three ways in: mutated Realtime events, mutated Twilio Media Streams
messages and mutated SDP offers, against one `duplex serve --model echo`, from clients that
leave at random points (close frame, reset, FIN without a close frame, or not reading at all).

Text frames that are not UTF-8 are left out: uvicorn refuses them itself (close 1007) and logs
its own stack for each, and two in a row make it fail the transport.

Afterwards the server must be healthy and hold nothing (no session, no engine bytes, no peer
connection sockets), every engine slot must be free again, no traceback may be in its log,
and every offer must have been answered 201 or 4xx with an OpenAI-style JSON error.
"""

import asyncio
import base64
import contextlib
import json
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, field

import httpx
import pytest
import websockets
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from duplex.access.errors import error_type
from duplex.transport.webrtc.calls import CONNECT_TIMEOUT_S
from duplex.transport.webrtc.ice import offer_host_addresses
from tests.waiting import eventually

SEED = 20240611
ENGINE_SLOTS = 8
REALTIME_WORKERS = 3
REALTIME_FRAMES = 24000
TWILIO_FRAMES = 12000
SDP_OFFERS = 150
LIVE_CALLS = 24
SID = "MZ00000000000000000000000000000001"

# -- mutation -------------------------------------------------------------------------------

WEIRD = [
    None, True, False, 0, -1, 1, 2**31, -(2**63), 2**64, 10**40, 1e308, -1e308, 0.5, -0.0,
    float("inf"), float("nan"), "", "x", "-1", "1e999", "NaN", "ä€😀", "\u0000", " ", "a" * 5000,
    "9" * 5000, [], [None], [1, "a", {}], {}, {"type": None}, {"": {"": []}},
]


def weird(rng: random.Random):
    return rng.choice(WEIRD)


def junk_text(rng: random.Random, n: int) -> str:
    alphabet = "{}[]\":,.-+eE0123456789 \\/nulltruefalseaz_\t\n\u00e9\u20ac\U0001f600\u0000"
    return "".join(rng.choice(alphabet) for _ in range(n))


def mutate(value, rng: random.Random, depth: int = 0):
    """One random change somewhere inside `value` (a JSON-like tree)."""
    if depth > 4 or rng.random() < 0.15:
        return weird(rng)
    if isinstance(value, dict) and value:
        out = dict(value)
        key = rng.choice(list(out))
        roll = rng.random()
        if roll < 0.5:
            out[key] = mutate(out[key], rng, depth + 1)
        elif roll < 0.7:
            del out[key]
        elif roll < 0.85:
            out[junk_text(rng, rng.randint(0, 8))] = weird(rng)
        else:
            out[key.upper()] = out.pop(key)
        return out
    if isinstance(value, list) and value:
        out = list(value)
        i = rng.randrange(len(out))
        roll = rng.random()
        if roll < 0.5:
            out[i] = mutate(out[i], rng, depth + 1)
        elif roll < 0.7:
            out.append(weird(rng))
        elif roll < 0.85:
            out = out * rng.randint(2, 50)
        else:
            out = []
        return out
    if isinstance(value, str) and value:
        roll = rng.random()
        if roll < 0.3:
            return value[: rng.randrange(len(value))]
        if roll < 0.6:
            return value + junk_text(rng, rng.randint(1, 20))
        if roll < 0.8:
            return value.upper()
    return weird(rng)


def garble(text: str, rng: random.Random) -> str:
    """Text that is no longer the JSON it was: cut, spliced or overwritten."""
    roll = rng.random()
    cut = rng.randrange(len(text) + 1)
    if roll < 0.4:
        return text[:cut]
    if roll < 0.7:
        return text[:cut] + junk_text(rng, rng.randint(1, 30)) + text[cut:]
    if roll < 0.85:
        return text[:cut] + text[cut + rng.randint(1, 20):]
    return junk_text(rng, rng.randint(0, 200))


def nested(depth: int, rng: random.Random) -> str:
    return "[" * depth + "]" * depth if rng.random() < 0.5 else '{"a":' * depth + "1" + "}" * depth


def frame(event: dict, rng: random.Random, depths: tuple[int, ...] = (50, 5000, 100000)) -> str | bytes:
    """`event` as sent, or one of the ways a frame goes wrong."""
    roll = rng.random()
    if roll < 0.45:
        return json.dumps(mutate(event, rng))
    if roll < 0.6:
        return json.dumps(event)
    if roll < 0.8:
        return garble(json.dumps(event), rng)
    if roll < 0.86:
        return json.dumps(rng.choice([[event], "event", 42, None, 1e308, [], True]))
    if roll < 0.9:
        return nested(rng.choice(depths), rng)
    if roll < 0.96:
        return rng.randbytes(rng.randint(0, 512))
    return json.dumps(event).replace('"', "'")


def b64(rng: random.Random, n: int) -> str:
    return base64.b64encode(rng.randbytes(n)).decode()


# -- clients --------------------------------------------------------------------------------


@dataclass
class Seen:
    """What the server told the fuzz clients, to aim later frames at real ids."""

    item_ids: list[str] = field(default_factory=lambda: ["item_0"])
    sessions: list[tuple[str, str]] = field(default_factory=list)
    marks: list[str] = field(default_factory=lambda: ["mark_0"])
    frames: int = 0

    def note(self, raw: str | bytes) -> None:
        event = json.loads(raw)
        if event.get("type") == "session.created" and "resume_token" in event["session"]:
            self.sessions.append((event["session"]["id"], event["session"]["resume_token"]))
        item = event.get("item")
        for item_id in (event.get("item_id"), item.get("id") if isinstance(item, dict) else None):
            if isinstance(item_id, str):
                self.item_ids.append(item_id)
        if event.get("event") == "mark":
            self.marks.append(event["mark"]["name"])
        del self.item_ids[:-50], self.marks[:-50], self.sessions[:-20]


def realtime_event(rng: random.Random, seen: Seen) -> dict:
    item = rng.choice(seen.item_ids)
    audio = b64(rng, rng.choice([0, 1, 3, 480, 4800, 48000]))
    session = {"type": "realtime", "instructions": "be brief", "output_modalities": ["audio"],
               "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                   "turn_detection": {"type": "server_vad", "threshold": 0.5,
                                                      "prefix_padding_ms": 300,
                                                      "silence_duration_ms": 200,
                                                      "create_response": True,
                                                      "interrupt_response": True},
                                   "transcription": {"model": "whisper-1"},
                                   "noise_reduction": {"type": "near_field"}},
                         "output": {"format": {"type": "audio/pcmu"}, "voice": "alloy",
                                    "speed": 1.0}},
               "tools": [{"type": "function", "name": "f", "description": "d",
                          "parameters": {"type": "object"}}],
               "tool_choice": "auto", "max_output_tokens": "inf", "truncation": "auto"}
    resume = rng.choice(seen.sessions) if seen.sessions else ("sess_x", "rt_x")
    events = [
        {"type": "session.update", "session": session},
        {"type": "session.update", "session": {"turn_detection": None, "modalities": ["text"],
                                               "input_audio_format": "g711_ulaw"}},
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.clear"},
        {"type": "output_audio_buffer.clear"},
        {"type": "conversation.item.create", "previous_item_id": item, "item": {
            "type": "message", "role": rng.choice(["user", "assistant", "system"]),
            "content": [{"type": "input_text", "text": "hi"},
                        {"type": "input_audio", "audio": audio},
                        {"type": "input_image", "image_url": "data:image/png;base64," + b64(rng, 64)}]}},
        {"type": "conversation.item.create", "item": {"type": "function_call_output",
                                                      "call_id": "call_1", "output": "{}"}},
        {"type": "conversation.item.delete", "item_id": item},
        {"type": "conversation.item.retrieve", "item_id": item},
        {"type": "conversation.item.truncate", "item_id": item, "content_index": 0,
         "audio_end_ms": rng.choice([0, 20, 1000, 10**9])},
        {"type": "response.create", "response": {"instructions": "x", "conversation": "auto",
                                                 "output_modalities": ["audio"], "metadata": {},
                                                 "max_output_tokens": 100, "input": []}},
        {"type": "response.create"},
        {"type": "response.cancel"},
        {"type": "session.resume", "session_id": resume[0], "resume_token": resume[1]},
    ]
    return rng.choice(events)


CONNECTED = {"event": "connected", "protocol": "Call", "version": "1.0.0"}


def twilio_start(seq: int) -> dict:
    return {"event": "start", "sequenceNumber": str(seq), "streamSid": SID, "start": {
        "streamSid": SID, "accountSid": "AC0", "callSid": "CA0", "tracks": ["inbound"],
        "customParameters": {"a": "b"},
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}


def twilio_event(rng: random.Random, seen: Seen, seq: int) -> dict:
    s = str(seq)
    events = [
        CONNECTED,
        twilio_start(seq),
        {"event": "dtmf", "streamSid": SID, "sequenceNumber": s,
         "dtmf": {"track": "inbound_track", "digit": rng.choice("0123456789*#")}},
        {"event": "mark", "streamSid": SID, "sequenceNumber": s,
         "mark": {"name": rng.choice(seen.marks)}},
        {"event": "stop", "streamSid": SID, "sequenceNumber": s,
         "stop": {"accountSid": "AC0", "callSid": "CA0"}},
    ]
    if rng.random() < 0.75:
        return {"event": "media", "sequenceNumber": s, "streamSid": SID, "media": {
            "track": "inbound", "chunk": s, "timestamp": str(seq * 20),
            "payload": b64(rng, rng.choice([160, 160, 160, 0, 1, 7, 1600]))}}
    return rng.choice(events)


async def reset(ws) -> None:
    if ws.transport.is_closing():
        return
    sock = ws.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def leave(ws, rng: random.Random, reader: asyncio.Task | None) -> None:
    """End a connection one of the ways a peer does."""
    how = rng.choice(["close", "close", "reset", "fin", "server"])
    try:
        if how == "close":
            await ws.close(rng.choice([1000, 1001, 4000, 3999]))
        elif how == "reset":
            await reset(ws)
        elif how == "fin":
            ws.transport.close()
        else:
            # Stay until the server ends it (only a peer that reads hears it), or give up.
            if reader is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(reader), 0.5)
            await reset(ws)
    except websockets.ConnectionClosed:
        pass
    if reader is not None:
        reader.cancel()


async def read(ws, seen: Seen) -> None:
    try:
        async for raw in ws:
            seen.note(raw)
    except websockets.ConnectionClosed:
        pass


async def fuzz_connection(url: str, rng: random.Random, frames, n: int, seen: Seen) -> None:
    try:
        ws = await websockets.connect(url, max_size=None, compression=None, close_timeout=2)
    except (OSError, websockets.InvalidHandshake):
        return
    # Some peers never read: the server's sends back up until the peer leaves.
    reader = asyncio.create_task(read(ws, seen)) if rng.random() < 0.85 else None
    try:
        for i in range(n):
            await ws.send(frames(i))
            seen.frames += 1
            if rng.random() < 0.02:
                await asyncio.sleep(rng.random() * 0.05)
    except websockets.ConnectionClosed:
        pass
    await leave(ws, rng, reader)


async def fuzz_realtime(server, seed: int, budget: int, seen: Seen) -> None:
    rng = random.Random(seed)
    url = server.url.replace("http", "ws") + "/v1/realtime"
    while seen.frames < budget:
        n = rng.choice([1, 5, 40, 120, 400])
        # Nested past what json.loads can parse, see the test below that expects to fail.
        await fuzz_connection(url, rng, lambda _i: frame(realtime_event(rng, seen), rng, (50, 500)),
                              n, seen)


async def fuzz_twilio(server, seed: int, budget: int, seen: Seen) -> None:
    rng = random.Random(seed)
    url = server.url.replace("http", "ws") + "/telephony/twilio"
    sent = 0
    while sent < budget:
        n = rng.choice([2, 20, 200, 600])
        start = seen.frames

        def frames(i: int):
            if i < 2 and rng.random() < 0.9:
                return json.dumps(twilio_start(i) if i else CONNECTED)
            event = twilio_event(rng, seen, i)
            return json.dumps(event) if rng.random() < 0.7 else frame(event, rng)

        await fuzz_connection(url, rng, frames, n, seen)
        sent += seen.frames - start


# -- SDP offers -----------------------------------------------------------------------------


SHAPES = ((["audio"], False), (["audio"], True), (["audio", "video"], True))
"""The offers aiortc makes: audio; audio and events; audio, video and events."""


async def offering_peer(kinds: list[str], channel: bool) -> RTCPeerConnection:
    offer_host_addresses(["127.0.0.1"])
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    for kind in kinds:
        pc.addTransceiver(kind)
    if channel:
        pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    return pc


async def base_offers() -> list[str]:
    offers = []
    for shape in SHAPES:
        pc = await offering_peer(*shape)
        offers.append(pc.localDescription.sdp)
        await pc.close()
    return offers


def mutate_sdp(sdp: str, rng: random.Random) -> str:
    lines = sdp.strip().split("\r\n")
    for _ in range(rng.choice([1, 1, 2, 3, 6])):
        i = rng.randrange(len(lines))
        roll = rng.random()
        if roll < 0.3:
            del lines[i]
            lines = lines or ["v=0"]
        elif roll < 0.45:
            lines.insert(i, lines[rng.randrange(len(lines))])
        elif roll < 0.7 and ":" in lines[i]:
            head, _, value = lines[i].partition(":")
            lines[i] = head + ":" + str(mutate(value, rng))
        elif roll < 0.8 and " " in lines[i]:
            words = lines[i].split(" ")
            words[rng.randrange(len(words))] = str(weird(rng))
            lines[i] = " ".join(words)
        elif roll < 0.9:
            lines.insert(i, rng.choice(["a=group:BUNDLE 7", "a=setup:actpass", "m=audio 9 UDP/TLS/RTP/SAVPF 0",
                                        "a=mid:0", "a=fingerprint:sha-256 00", "a=ice-ufrag:x",
                                        "a=end-of-candidates", "m=application 9 DTLS/SCTP x",
                                        "a=rtcp-mux", "a=sctp-port:x", junk_text(rng, 10)]))
        else:
            lines[i] = garble(lines[i], rng)
    return "\r\n".join(lines) + rng.choice(["\r\n", "\n", ""])


async def post_offer(client: httpx.AsyncClient, url: str, sdp: str, rng: random.Random):
    roll = rng.random()
    if roll < 0.6:
        return await client.post(url, content=sdp.encode("utf-8", "surrogatepass"),
                                 headers={"Content-Type": "application/sdp"})
    if roll < 0.9:
        files = {"sdp": (None, sdp, "application/sdp")}
        if rng.random() < 0.7:
            session = {"type": "realtime", "instructions": "x", "audio": {"input": {
                "turn_detection": None}}}
            files["session"] = (None, rng.choice([json.dumps(session), json.dumps(mutate(session, rng)),
                                                  garble(json.dumps(session), rng),
                                                  nested(100000, rng)]))
        return await client.post(url, files=files)
    body = rng.choice([sdp.encode(), rng.randbytes(200), b"--x\r\n\r\n", b""])
    content_type = rng.choice(["multipart/form-data; boundary=x", "multipart/form-data",
                               "application/sdp; charset=latin-1", "text/plain", ""])
    return await client.post(url, content=body, headers={"Content-Type": content_type})


async def cut_off_offer(server, sdp: str, rng: random.Random) -> None:
    """A POST whose body never arrives in full: the client leaves halfway."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    body = sdp.encode()
    writer.write(b"POST /v1/realtime/calls HTTP/1.1\r\nHost: x\r\nContent-Type: application/sdp\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[: rng.randrange(len(body))])
    await writer.drain()
    writer.transport.abort()


def is_error_body(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (error.get("type") == error_type(response.status_code)
            and isinstance(error.get("code"), str)
            and isinstance(error.get("message"), str) and "param" in error)


async def fuzz_sdp(server, seed: int, offers: list[str], statuses: dict[int, int]) -> None:
    rng = random.Random(seed)
    url = f"{server.url}/v1/realtime/calls"
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(SDP_OFFERS):
            sdp = mutate_sdp(rng.choice(offers), rng) if rng.random() < 0.9 else rng.choice(offers)
            if rng.random() < 0.05:
                await cut_off_offer(server, sdp, rng)
                continue
            response = await post_offer(client, url, sdp, rng)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code == 201:
                # The caller goes away without ever connecting.
                hung = await client.post(server.url + response.headers["location"] + "/hangup")
                assert hung.status_code == 200
            else:
                assert 400 <= response.status_code < 500 and is_error_body(response), (
                    response.status_code, response.text, sdp)


async def fuzz_live_calls(server, seed: int, connected: list[bool]) -> None:
    """Mutated offers from peers that are really there: where one is answered, the peer takes
    the answer and the server's ICE and DTLS start on what the mutation left (a fingerprint
    that does not match, a setup role flipped, a port changed); then the peer leaves."""
    rng = random.Random(seed)
    url = f"{server.url}/v1/realtime/calls"
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(LIVE_CALLS):
            pc = await offering_peer(*rng.choice(SHAPES))
            try:
                response = await client.post(
                    url, content=mutate_sdp(pc.localDescription.sdp, rng).encode(),
                    headers={"Content-Type": "application/sdp"})
                assert response.status_code == 201 or (
                    400 <= response.status_code < 500 and is_error_body(response)), response.text
                if response.status_code != 201:
                    continue
                with contextlib.suppress(Exception):  # an answer to a mangled offer may not fit
                    await pc.setRemoteDescription(
                        RTCSessionDescription(sdp=response.text, type="answer"))
                # A mangled offer may leave it connecting: either ending is fine here.
                await eventually(lambda pc=pc: pc.connectionState in ("connected", "failed",
                                                                      "closed"), None, 3)
                connected.append(pc.connectionState == "connected")
            finally:
                await pc.close()


# -- the test -------------------------------------------------------------------------------


async def all_slots_open(server) -> bool:
    """Every engine slot admits a session at once: none is still held by a fuzz session."""
    url = server.url.replace("http", "ws") + "/v1/realtime"
    clients = [await websockets.connect(url) for _ in range(ENGINE_SLOTS)]
    try:
        firsts = [json.loads(await ws.recv())["type"] for ws in clients]
    finally:
        for ws in clients:
            await ws.close()
    return firsts == ["session.created"] * ENGINE_SLOTS


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_fuzzed_frames_and_offers_leave_nothing_behind(
        server_process, holdings, wait_released):
    env = {**os.environ, "DUPLEX_ENGINE__MAX_SESSIONS": str(ENGINE_SLOTS)}
    server = server_process("--model", "echo", env=env)
    udp = (await holdings(server))["udp_sockets"]
    offers = await base_offers()
    realtime_seen, twilio_seen = Seen(), Seen()
    statuses: dict[int, int] = {}
    connected: list[bool] = []
    started = time.monotonic()
    await asyncio.gather(
        *(fuzz_realtime(server, SEED + i, REALTIME_FRAMES, realtime_seen)
          for i in range(REALTIME_WORKERS)),
        fuzz_twilio(server, SEED + 100, TWILIO_FRAMES, twilio_seen),
        fuzz_sdp(server, SEED + 200, offers, statuses),
        fuzz_live_calls(server, SEED + 300, connected),
    )
    fuzzed_s = time.monotonic() - started
    print(f"fuzzed {realtime_seen.frames} Realtime and {twilio_seen.frames} Twilio frames, "
          f"{sum(statuses.values())} offers {statuses}, {len(connected)} answered live calls "
          f"({sum(connected)} connected), in {fuzzed_s:.1f} s")

    # Shorter than the connect deadline: a call that only it would end fails this.
    await wait_released(server, udp, timeout_s=CONNECT_TIMEOUT_S - 3)
    assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
    assert await all_slots_open(server)
    await wait_released(server, udp)
    assert statuses.get(201), "no offer was accepted: the mutations never left one intact"


@pytest.mark.slow
async def test_a_realtime_frame_nested_too_deep_is_an_error_event(server_process, wait_released):
    server = server_process("--model", "echo")
    async with websockets.connect(server.url.replace("http", "ws") + "/v1/realtime") as ws:
        await ws.recv()
        await ws.send(nested(100000, random.Random(0)))
        error = json.loads(await ws.recv())
        assert (error["type"], error["error"]["code"]) == ("error", "invalid_json")
    await wait_released(server)
