"""Two real WebRTC peers: an aiortc client against `duplex serve --model echo`."""

import asyncio
import fractions
import json
import time

import av
import httpx
import numpy as np
import pytest
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from duplex.bench.listener import cough
from duplex.bench.synth import babble
from duplex.transport.webrtc.ice import offer_host_addresses
from tests.transport.hearing import assert_heard_whole, hearing, split_at_silence, trimmed
from tests.waiting import eventually

RATE = 48000
FRAME = 960


class ScriptedMic(MediaStreamTrack):
    """A microphone that plays queued audio in real time and silence in between."""

    kind = "audio"

    def __init__(self):
        super().__init__()
        self.queue = np.zeros(0, np.float32)
        self.pts = 0
        self.start = None

    def say(self, audio: np.ndarray) -> None:
        self.queue = np.concatenate([self.queue, audio.astype(np.float32)])

    async def recv(self):
        if self.readyState != "live":
            raise MediaStreamError
        if self.start is None:
            self.start = time.monotonic()
        await asyncio.sleep(max(0.0, self.start + self.pts / RATE - time.monotonic()))
        chunk = np.zeros(FRAME, np.float32)
        n = min(FRAME, len(self.queue))
        chunk[:n], self.queue = self.queue[:n], self.queue[n:]
        frame = av.AudioFrame.from_ndarray(
            (np.clip(chunk, -1, 1) * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate, frame.pts, frame.time_base = RATE, self.pts, fractions.Fraction(1, RATE)
        self.pts += FRAME
        return frame


class Caller:
    def __init__(self):
        offer_host_addresses(["127.0.0.1"])
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.mic = ScriptedMic()
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: list[tuple[float, dict]] = []
        self.heard: list[tuple[float, np.ndarray]] = []
        self.tasks = []
        self.channel.on("message", lambda m: self.events.append((time.monotonic(), json.loads(m))))
        self.pc.on("track", self._on_track)

    def _on_track(self, track):
        async def read():
            resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
            while True:
                try:
                    frame = await track.recv()
                except MediaStreamError:
                    return
                for out in resampler.resample(frame):
                    self.heard.append((time.monotonic(), out.to_ndarray().reshape(-1)))

        self.tasks.append(asyncio.create_task(read()))

    async def connect(self, base_url: str, key: str | None = None,
                      query: str = "") -> httpx.Response:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        headers = {"Content-Type": "application/sdp"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        async with httpx.AsyncClient() as client:
            answer = await client.post(
                f"{base_url}/v1/realtime/calls{query}",
                content=self.pc.localDescription.sdp,
                headers=headers,
            )
        assert answer.status_code == 201, answer.text
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
        return answer

    def send(self, event: dict) -> None:
        """A client event on the data channel."""
        self.channel.send(json.dumps(event))

    def types(self):
        return [e["type"] for _, e in self.events]

    async def wait_for(self, type_, count=1, timeout=20.0):
        if not await eventually(lambda: self.types().count(type_) >= count, None, timeout):
            raise AssertionError(f"no {count} x {type_} after {timeout} s in {self.types()}")
        return [e for _, e in self.events if e["type"] == type_][count - 1]

    def heard_since(self, t: float, until: float = float("inf")) -> np.ndarray:
        """What the reply track played from `t` on (until `until`)."""
        after = [pcm for at, pcm in self.heard if t <= at < until]
        return np.concatenate(after) if after else np.zeros(0, np.float32)

    def at(self, event: dict) -> float:
        return next(t for t, e in self.events if e is event)

    async def hear_until(self, t: float, timeout: float = 10.0) -> None:
        """Wait until the reply track has played past `t`: it runs on its own clock, silence
        included, so what it played up to then has all arrived."""
        await eventually(lambda: self.heard and self.heard[-1][0] > t,
                         "the reply track plays on", timeout)

    async def close(self):
        for task in self.tasks:
            task.cancel()
        await self.pc.close()


def best_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Peak normalised cross-correlation of b inside a (b shorter). By FFT: the direct sum
    takes seconds for a few seconds of audio, and while it runs the test's microphone is not
    fed and falls behind real time."""
    a, b = a.astype(np.float64) - a.mean(), b.astype(np.float64) - b.mean()
    n, size = len(b), len(a) + len(b)
    corr = np.fft.irfft(np.fft.rfft(a, size) * np.conj(np.fft.rfft(b, size)), size)[: len(a) - n + 1]
    power = np.concatenate([[0.0], np.cumsum(a * a)])
    energy = np.sqrt(np.maximum(power[n:] - power[:-n], 0.0) * np.dot(b, b))
    return float(np.max(corr / np.maximum(energy, 1e-9)))


@pytest.mark.timing
@pytest.mark.slow
async def test_echo_over_webrtc_a_cough_pauses_the_track_and_it_resumes_whole_then_barge_in(
        server_process):
    server = server_process("--model", "echo")
    caller = Caller()
    try:
        answer = await caller.connect(server.url, query="?duplex_events=1")
        assert answer.headers["content-type"].startswith("application/sdp")
        call_path = answer.headers["location"]
        assert call_path.startswith("/v1/realtime/calls/rtc_")
        created = await caller.wait_for("session.created")
        assert created["session"]["id"].startswith("sess_")

        speech = np.clip(babble(RATE * 2, rate=RATE, seed=21), -1, 1)
        caller.mic.say(np.concatenate([np.zeros(RATE // 2), speech]))
        await caller.wait_for("output_audio_buffer.started", timeout=30)
        started_at = time.monotonic()
        done = await caller.wait_for("response.done", timeout=30)
        assert done["response"]["status"] == "completed"
        stopped = await caller.wait_for("output_audio_buffer.stopped")
        stopped_at = next(t for t, e in caller.events if e is stopped)
        await caller.hear_until(stopped_at + 0.3)
        # The reply track carries the caller's own words back, through two Opus passes.
        heard = caller.heard_since(started_at - 0.2)
        assert best_correlation(heard, speech[RATE // 2 : RATE]) > 0.6

        # The same again, and a cough 0.8 s into its reply: the track holds at the pause (its
        # frames go quiet), plays on from there once the cough is judged false, and the caller
        # hears the whole reply as it heard the first (through the same Opus passes).
        caller.mic.say(speech)
        started = await caller.wait_for("output_audio_buffer.started", count=2, timeout=30)
        reply = started["response_id"]
        await eventually(lambda: sum(np.sqrt(np.mean(pcm**2)) > 0.01 for t, pcm in caller.heard
                                     if t >= caller.at(started)) >= 40, "0.8 s of the reply")
        caller.mic.say(cough(RATE))
        paused = await caller.wait_for("duplex.output.paused")
        resumed = await caller.wait_for("duplex.output.resumed")
        assert paused["response_id"] == resumed["response_id"] == reply
        done = await caller.wait_for("response.done", count=2, timeout=30)
        assert done["response"]["status"] == "completed"
        stopped = await caller.wait_for("output_audio_buffer.stopped", count=2)
        await caller.hear_until(caller.at(stopped) + 0.5)
        parts = split_at_silence(caller.heard_since(caller.at(started), caller.at(stopped) + 0.5),
                                 RATE)
        # Two parts, or one where the speech was judged as soon as the pause began (a loaded
        # host's speech detector answers a cough's frames all at once).
        assert len(parts) in (1, 2)
        assert_heard_whole(hearing(parts, trimmed(heard), RATE))

        # Next turn: talk over the reply once it plays.
        caller.mic.say(babble(RATE, rate=RATE, seed=23))
        await caller.wait_for("output_audio_buffer.started", count=3, timeout=30)
        replying_at = time.monotonic()
        await eventually(lambda: any(np.sqrt(np.mean(pcm**2)) > 0.05
                                     for t, pcm in caller.heard if t >= replying_at),
                         "the second reply is heard")
        # Talk over the reply: the server cancels it and its track goes quiet at once.
        caller.mic.say(babble(RATE, rate=RATE, seed=22))
        done = await caller.wait_for("response.done", count=3, timeout=20)
        assert done["response"]["status"] == "cancelled"
        cleared = await caller.wait_for("output_audio_buffer.cleared")
        assert cleared["response_id"] == done["response"]["id"]
        cleared_at = next(t for t, e in caller.events if e is cleared)
        await caller.hear_until(cleared_at + 0.9)
        tail = caller.heard_since(cleared_at + 0.3)
        assert len(tail) and np.sqrt(np.mean(tail**2)) < 0.01
        types = caller.types()
        barge = [i for i, t in enumerate(types) if t == "input_audio_buffer.speech_started"][3]
        assert barge < [i for i, t in enumerate(types) if t == "response.done"][2]

        async with httpx.AsyncClient() as client:
            hung = await client.post(f"{server.url}{call_path}/hangup")
            assert hung.status_code == 200
            missing = await client.post(f"{server.url}/v1/realtime/calls/rtc_nope/hangup")
            assert missing.status_code == 404

            async def ended() -> bool:
                return (await client.get(f"{server.url}/healthz")).json()["active_sessions"] == 0

            await eventually(ended, "the hung-up call's session ends")
    finally:
        await caller.close()


@pytest.mark.slow
async def test_bad_offers_are_refused_with_reasons(server_process):
    server = server_process("--model", "echo")
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{server.url}/v1/realtime/calls", content="hello",
                              headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = await client.post(f"{server.url}/v1/realtime/calls", content="v=0\r\n",
                              headers={"Content-Type": "application/sdp"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_offer"
        r = await client.post(f"{server.url}/v1/realtime/calls", files={"session": (None, "{}")})
        assert r.status_code == 400 and "sdp" in r.json()["error"]["message"]


@pytest.mark.slow
async def test_calls_count_against_the_session_limit(server_process):
    import os

    import websockets

    server = server_process("--model", "echo", env={**os.environ, "DUPLEX_LIMITS__SESSIONS": "1"})
    caller = Caller()
    try:
        await caller.connect(server.url)
        await caller.wait_for("session.created")
        url = server.url.replace("http", "ws") + "/v1/realtime"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url):
                pass
        assert refused.value.response.status_code == 429
        second = Caller()
        await second.pc.setLocalDescription(await second.pc.createOffer())
        async with httpx.AsyncClient() as client:
            r = await client.post(f"{server.url}/v1/realtime/calls", content=second.pc.localDescription.sdp,
                                  headers={"Content-Type": "application/sdp"})
        await second.close()
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
    finally:
        await caller.close()
