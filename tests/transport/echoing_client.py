"""A Realtime client on a speakerphone: it plays every reply as it arrives and its microphone
hears that playback again (delayed, attenuated, filtered), mixed with whatever its user says.

Its clock is the wall clock in samples from its start: microphone frame i covers samples
[i * FRAME, (i + 1) * FRAME) and is sent at that time; reply audio plays on that clock
(duplex.bench.playout) from when it arrives (or when the audio before it ends), as a browser's
or a phone's buffer does, and what has not played is dropped at speech_started, as LiveKit,
Pipecat and the OpenAI Agents SDK drop their own playback.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import soxr

from duplex.bench.playout import Playout
from tests.transcription.fixtures import speak
from tests.waiting import eventually

RATE = 24000
FRAME = RATE // 50
FRAME_S = FRAME / RATE
LOUDSPEAKER = np.array([0.1, 0.2, 0.4, 0.2, 0.1], np.float32)
"""A small loudspeaker and room: the high end of the reply is gone by the time it is heard."""


def utterance(text: str, rate: int = RATE) -> np.ndarray:
    """espeak-ng speaking `text`, at `rate` (24 kHz unless told)."""
    return soxr.resample(speak(text), 16000, rate).astype(np.float32)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


class EchoingClient:
    def __init__(self, ws, delay_ms: int, gain_db: float, seconds: float = 60.0) -> None:
        self.ws = ws
        self.delay = delay_ms * RATE // 1000
        self.gain = 10 ** (gain_db / 20)
        self.playout = Playout()
        """What the loudspeaker plays, on this clock, by reply."""
        self.user = np.zeros(int(seconds * RATE), np.float32)
        """What the user says, by clock sample."""
        self.frames_sent = 0
        self.t0 = 0.0
        self.events: list[tuple[float, dict]] = []
        """(time on this clock, in seconds, event) of every server event."""
        self.deltas: list[tuple[float, str, bytes]] = []
        """(time, response id, audio) of every reply audio delta."""
        self._tasks: list[asyncio.Task] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def start(self) -> None:
        self.t0 = time.monotonic()
        self._tasks = [asyncio.create_task(self._microphone()), asyncio.create_task(self._read())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    def say(self, pcm: np.ndarray, after_s: float = 0.04) -> float:
        """The user says `pcm`, starting `after_s` from now; returns its onset (s)."""
        at = int((self.now() + after_s) * RATE)
        self.user[at : at + len(pcm)] += pcm[: len(self.user) - at]
        return at / RATE

    async def _microphone(self) -> None:
        while True:
            i = self.frames_sent
            await asyncio.sleep(max(0.0, (i + 1) * FRAME_S - self.now()))
            a, b = i * FRAME, (i + 1) * FRAME
            heard = self.playout.between(a - self.delay - len(LOUDSPEAKER) + 1, b - self.delay)
            echo = np.convolve(heard, LOUDSPEAKER, mode="valid") * self.gain
            await self.send(type="input_audio_buffer.append",
                            audio=base64.b64encode(pcm16(self.user[a:b] + echo)).decode())
            self.frames_sent += 1

    async def _read(self) -> None:
        async for raw in self.ws:
            now = self.now()
            event = json.loads(raw)
            self.events.append((now, event))
            if event["type"] == "response.output_audio.delta":
                audio = base64.b64decode(event["delta"])
                self.deltas.append((now, event["response_id"], audio))
                pcm = np.frombuffer(audio, "<i2").astype(np.float32) / 32768
                self.playout.push(int(now * RATE), pcm, event["response_id"])
            elif event["type"] == "input_audio_buffer.speech_started":
                # What plays after now never will: the client drops its buffer.
                self.playout.clear(int(now * RATE))

    async def wait_for(self, type_: str, after: float = 0.0, timeout_s: float = 30.0,
                       **match) -> tuple[float, dict]:
        def found():
            return next(((t, event) for t, event in self.events
                         if t >= after and event["type"] == type_
                         and all(event.get(k) == v for k, v in match.items())), None)

        return await eventually(found, f"a {type_} event", timeout_s)

    def between(self, type_: str, start: float, end: float) -> list[dict]:
        return [e for t, e in self.events if start <= t <= end and e["type"] == type_]

    def reply_audio(self, response_id: str) -> bytes:
        return b"".join(audio for _, rid, audio in self.deltas if rid == response_id)

    def delivery_gaps(self, response_id: str) -> list[tuple[float, float]]:
        """(from, to) of each pause longer than 250 ms between audio deltas of a reply."""
        times = [t for t, rid, _ in self.deltas if rid == response_id]
        return [(a, b) for a, b in zip(times, times[1:], strict=False) if b - a > 0.25]
