"""A simulated Twilio peer calls `duplex serve --model echo` (a real subprocess, real VAD).

The peer sends paced 20 ms mu-law frames, plays what it receives on its own clock, echoes each
mark only once the audio queued before it has played (or at once when a clear drops it, as
Twilio does), and talks over the reply once. What the test checks is what Twilio and an
operator see: the media, marks and clear the bridge sends, and the server's /metrics.
"""

import asyncio
import base64
import json
import os
import re
import time

import httpx
import numpy as np
import pytest
import websockets

from duplex.bench.playout import Playout
from duplex.bench.synth import babble
from duplex.media import ulaw_decode, ulaw_encode
from tests.waiting import eventually

RATE = 8000
FRAME = 160
FRAME_S = FRAME / RATE
SID = "MZ00000000000000000000000000000001"


def mulaw(x: np.ndarray) -> bytes:
    return ulaw_encode((np.clip(x, -1, 1) * 32767).astype(np.int16))


def decoded(data: bytes) -> np.ndarray:
    return ulaw_decode(data).astype(np.float32) / 32768


class Peer:
    """Twilio and the caller's phone: sends the caller's frames, plays what comes on the
    phone's own clock (duplex.bench.playout: samples at 8 kHz since the peer began), echoes
    each mark when playback reaches it, and empties its buffer at a clear."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.outq: asyncio.Queue = asyncio.Queue()
        self.seq = 0
        self.chunk = 0
        self.next_frame_at = 0.0
        self.sent_samples = 0
        """Every sample in a decodable media payload, taken by the server or not."""
        self.taken: list[tuple[int, float]] = []
        """(end sample on the server's input clock, time sent) of each frame it should take."""
        self.taken_audio: list[bytes] = []
        self.taken_put = 0
        self.t0 = time.time()
        self.playout = Playout()
        self._pending: list[np.ndarray] = []
        """Frames received since the last mark, which names their reply."""
        self.media_in: list[tuple[float, bytes]] = []
        self.marks_in: list[tuple[float, str]] = []
        self.played: list[tuple[float, str]] = []
        """Marks echoed because their audio played: (time, name)."""
        self.dropped_marks: list[str] = []
        self.echoes: dict[str, asyncio.Task] = {}
        self.clears: list[float] = []
        self.tasks: list[asyncio.Task] = []

    def clock(self, t: float | None = None) -> int:
        """The phone's clock at time `t` (now): samples since the peer began."""
        return round(((time.time() if t is None else t) - self.t0) * RATE)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.writer()), asyncio.create_task(self.reader())]

    async def hang_up(self, message: dict, timeout: float) -> None:
        """Send the call's last message (a stop, or the end-call digit), wait for the server
        to close the stream, and wind the peer down."""
        self.put(message)
        await asyncio.wait_for(self.tasks[1], timeout)
        self.outq.put_nowait(None)
        await self.tasks[0]
        for task in self.echoes.values():
            task.cancel()

    # -- sending -------------------------------------------------------------------------

    async def writer(self) -> None:
        while (item := await self.outq.get()) is not None:
            message, taken = item
            if "sequenceNumber" not in message and message["event"] != "connected":
                self.seq += 1
                message = {"event": message.pop("event"), "sequenceNumber": str(self.seq), **message}
            try:
                await self.ws.send(json.dumps(message))
            except websockets.ConnectionClosed:
                return
            if taken:
                self.taken.append((len(self.taken_audio) * FRAME + taken, time.time()))
                self.taken_audio.append(base64.b64decode(message["media"]["payload"]))

    def put(self, message: dict, taken: int = 0) -> None:
        self.outq.put_nowait((message, taken))

    def media(self, payload: bytes, *, taken: bool = True, **extra) -> None:
        self.chunk += 1
        self.sent_samples += len(payload)
        self.taken_put += 1 if taken else 0
        self.put({"event": "media", "streamSid": SID, **extra, "media": {
            "track": "inbound", "chunk": str(self.chunk),
            "timestamp": str((self.chunk - 1) * 20), "payload": base64.b64encode(payload).decode(),
        }}, len(payload) if taken else 0)

    async def speak(self, signal: np.ndarray) -> None:
        """Frames at real time on one continuous 20 ms cadence."""
        for i in range(0, len(signal), FRAME):
            self.next_frame_at = max(self.next_frame_at + FRAME_S, time.time() - FRAME_S)
            await asyncio.sleep(max(0.0, self.next_frame_at - time.time()))
            self.media(mulaw(signal[i : i + FRAME]))

    # -- receiving and playing -----------------------------------------------------------

    async def reader(self) -> None:
        async for raw in self.ws:
            now = time.time()
            event = json.loads(raw)
            assert event["streamSid"] == SID
            if event["event"] == "media":
                payload = base64.b64decode(event["media"]["payload"])
                self.media_in.append((now, payload))
                self._pending.append(decoded(payload))
            elif event["event"] == "mark":
                name = event["mark"]["name"]
                self.marks_in.append((now, name))
                reply = int(name.split(".")[1][1:])
                self.playout.push(self.clock(now), np.concatenate(self._pending), reply)
                self._pending.clear()
                due = self.playout.mark(self.clock(now), name)
                self.echoes[name] = asyncio.create_task(self.echo_when_played(due))
            elif event["event"] == "clear":
                self.clears.append(now)
                self._pending.clear()
                for name in self.playout.clear(self.clock(now)):
                    self.echoes.pop(name).cancel()
                    self.dropped_marks.append(name)
                    self.echo(name)
            else:
                raise AssertionError(f"unexpected event {event}")

    async def echo_when_played(self, due: int) -> None:
        await asyncio.sleep(max(0.0, self.t0 + due / RATE - time.time()))
        for name in self.playout.reached(self.clock()):
            self.echoes.pop(name, None)
            self.played.append((time.time(), name))
            self.echo(name)

    def echo(self, name: str) -> None:
        self.put({"event": "mark", "streamSid": SID, "mark": {"name": name}})

    def heard_s(self) -> float:
        """Seconds of reply played so far on the phone's clock."""
        return self.playout.played(self.clock()) / RATE

    def playing_until(self) -> float:
        """When what the phone holds will have played."""
        return self.t0 + self.playout.end / RATE


def metric_values(text: str, name: str, label: str, **where: str) -> dict[str, float]:
    """The series of one /metrics family whose labels include `where`, by the value of `label`."""
    out = {}
    for m in re.finditer(rf"^{name}{{(.*)}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if all(labels.get(k) == v for k, v in where.items()):
            out[labels[label]] = float(m[2])
    return out


async def wait_until(condition, timeout_s: float, what: str, peer: Peer) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        await peer.speak(np.zeros(FRAME, np.float32))


def best_ncc(reply: np.ndarray, caller: np.ndarray, start: int, max_lag: int = 320) -> float:
    seg = reply[start:]
    best = 0.0
    for lag in range(-max_lag, max_lag + 1):
        ref = caller[start + lag : start + lag + len(seg)]
        n = min(len(seg), len(ref))
        a, b = seg[:n], ref[:n]
        best = max(best, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-9)))
    return best


@pytest.mark.slow
async def test_a_twilio_call_with_barge_in_against_the_echo_model(server_process):
    server = server_process("--model", "echo",
                            env={**os.environ, "DUPLEX_TELEPHONY__END_CALL_DIGIT": "#"})
    twiml = httpx.post(f"{server.url}/telephony/twilio/twiml")
    assert twiml.headers["content-type"].startswith("text/xml")
    assert f'<Stream url="wss://127.0.0.1:{server.port}/telephony/twilio"/>' in twiml.text

    silence = np.zeros(RATE, np.float32)
    turn = np.concatenate([silence[: RATE // 5], babble(RATE * 9 // 5, rate=RATE, seed=11)])
    interruption = babble(RATE * 3 // 5, rate=RATE, seed=12)
    ws_url = server.url.replace("http", "ws") + "/telephony/twilio"
    async with websockets.connect(ws_url, compression=None) as ws:
        peer = Peer(ws)
        peer.start()
        peer.put({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        peer.media(mulaw(silence[:FRAME]), taken=False, sequenceNumber="1")  # before start
        peer.put({"event": "start", "sequenceNumber": "1", "streamSid": SID, "start": {
            "streamSid": SID, "accountSid": "AC0", "callSid": "CA0", "tracks": ["inbound"],
            "customParameters": {"caller": "test"},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
        peer.seq = 1
        peer.next_frame_at = time.time()
        await peer.speak(turn[: RATE // 5])
        peer.media(mulaw(silence[:FRAME]), taken=False, sequenceNumber="3")  # replayed number
        peer.put({"event": "media", "streamSid": SID, "media": {
            "track": "inbound", "chunk": "0", "timestamp": "0", "payload": "not*base64"}})
        peer.put({"event": "hangup", "streamSid": SID})
        peer.put({"event": "mark", "streamSid": SID, "mark": {"name": "never-sent"}})
        await peer.speak(turn[RATE // 5 :])

        # Silence ends the turn and its echo plays; 0.8 s in, the caller talks over it.
        await wait_until(lambda: peer.heard_s() >= 0.8, 10.0, "the reply", peer)
        onset_frame = peer.taken_put
        await peer.speak(interruption)
        speech_end = time.time()
        await wait_until(lambda: peer.clears and len(peer.media_in) > 0
                         and peer.media_in[-1][0] > peer.clears[0] + 0.2, 10.0,
                         "the reply to the interruption", peer)
        await peer.speak(silence[: RATE // 5])
        await peer.hang_up({"event": "dtmf", "streamSid": SID,
                            "dtmf": {"track": "inbound_track", "digit": "#"}}, 5.0)
        assert ws.close_code == 1000

    # The call's books reach /metrics once the server has let go of it.
    async with httpx.AsyncClient() as client:
        async def ended() -> bool:
            return (await client.get(f"{server.url}/healthz")).json()["active_sessions"] == 0

        await eventually(ended, "the server ends the call")
        metrics = (await client.get(f"{server.url}/metrics")).text

    # Every refused message is counted by its reason, and the samples they carried as dropped.
    reasons = {"before_start", "out_of_order", "bad_base64", "unknown_event", "unknown_mark"}
    assert metric_values(metrics, "duplex_telephony_rejected_total", "reason") == (
        dict.fromkeys(reasons, 1.0))
    assert metric_values(metrics, "duplex_dropped_total", "reason", kind="inbound") == {
        "before_start": FRAME, "out_of_order": FRAME}
    assert metric_values(metrics, "duplex_telephony_dtmf_total", "digit") == {"#": 1.0}

    # The reply paused as soon as the server heard the caller over it, and Twilio's buffer was
    # cleared then, not once the speech had lasted telephony.min_interruption_ms (400 ms by
    # default); it lasted, and cut the reply: the call's one barge-in. How soon the phone went
    # quiet is the bench's business (duplex bench --listener); printed for a look.
    clear_at = peer.clears[0]
    onset_sent = peer.taken[onset_frame][1]
    assert onset_sent < clear_at
    assert re.search(r"^duplex_barge_in_seconds_count 1\.0$", metrics, re.M)
    assert re.search(r"^duplex_interruptions_total 1\.0$", metrics, re.M)
    stop = peer.playout.stopped(peer.clock(onset_sent), 0)
    assert stop == peer.clock(clear_at)
    print(f"barge-in: the phone played the reply until {1000 * (stop / RATE + peer.t0 - onset_sent):.0f}"
          " ms after the onset's frame was sent")

    # Nothing of the cancelled reply after the clear (or the last, if the speech paused the
    # reply more than once): the next audio is the next reply's.
    first_reply = [payload for t, payload in peer.media_in if t < clear_at]
    later = [t for t, _ in peer.media_in if t >= peer.clears[-1]]
    assert later and min(later) > speech_end + 0.3
    names_after = [name for t, name in peer.marks_in if t >= peer.clears[-1]]
    assert names_after and all(name.startswith("duplex.r1.") for name in names_after)
    assert all(name.startswith("duplex.r0.") for name in peer.dropped_marks)

    # Marks of the cancelled reply that Twilio played before the clear came back as played.
    assert any(t < clear_at and name.startswith("duplex.r0.") for t, name in peer.played)

    # The echo model's reply is the caller's own audio, through two mu-law trips.
    caller = decoded(b"".join(peer.taken_audio))
    ncc = best_ncc(decoded(b"".join(first_reply)), caller, start=RATE // 5)
    print(f"reply/caller normalised cross-correlation {ncc:.3f}")
    assert ncc > 0.9
