"""`duplex call`: stream a sound file to a Realtime endpoint in real time and save the reply."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import websockets

from duplex.media import float_to_pcm16
from duplex.media.rates import REALTIME_RATE

RATE = REALTIME_RATE
FRAME = RATE // 50


def read_audio(path: str | Path) -> np.ndarray:
    """Any file FFmpeg reads, as float32 mono at 24 kHz."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
    chunks = []
    with av.open(str(path)) as container:
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
    for out in resampler.resample(None):
        chunks.append(out.to_ndarray().reshape(-1))
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)


@dataclass
class CallResult:
    timeline: list[tuple[float, str, str]] = field(default_factory=list)
    reply: bytearray = field(default_factory=bytearray)
    ttfa_ms: list[float] = field(default_factory=list)


TURN_DETECTION = "semantic_vad"
"""How `duplex call` asks the server to end its turns: when the end-of-turn model judges the
speech complete (or after its longest wait, 4 s), not the Realtime API's default server_vad."""


async def call(url: str, audio: np.ndarray, barge_in_at: float | None = None,
               tail_s: float = 5.0, timeout_s: float = 120.0, api_key: str | None = None,
               turn_detection: str = TURN_DETECTION) -> CallResult:
    """Send `audio` paced at real time, then silence until the replies are done (at least
    `tail_s`, which outlasts semantic_vad's longest wait)."""
    result = CallResult()
    stream = audio
    if barge_in_at is not None:
        # The caller talks again at barge_in_at seconds: the same audio, over the reply.
        start = int(barge_in_at * RATE)
        stream = np.zeros(max(len(audio), start + len(audio)), np.float32)
        stream[: len(audio)] = audio
        stream[start : start + len(audio)] += audio
    stream = np.concatenate([stream, np.zeros(int(tail_s * RATE), np.float32)])
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with websockets.connect(url, additional_headers=headers, max_size=None,
                                  compression=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": {"type": turn_detection}}}}}))
        t0 = time.monotonic()
        speech_end_ms: list[int] = []
        first_delta_after: set[int] = set()
        pending = {"responses": 0}

        def stamp(kind: str, detail: str = "") -> None:
            result.timeline.append((round(time.monotonic() - t0, 3), kind, detail))

        async def sender() -> None:
            for i in range(0, len(stream), FRAME):
                due = t0 + i / RATE
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                chunk = float_to_pcm16(stream[i : i + FRAME])
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(chunk).decode()}))

        async def receiver() -> None:
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind == "response.output_audio.delta":
                    result.reply += base64.b64decode(event["delta"])
                    if speech_end_ms and len(speech_end_ms) not in first_delta_after:
                        first_delta_after.add(len(speech_end_ms))
                        ttfa = (time.monotonic() - t0) * 1000 - speech_end_ms[-1]
                        result.ttfa_ms.append(round(ttfa, 1))
                        stamp("first_audio", f"ttfa {ttfa:.0f} ms")
                    continue
                if kind == "response.output_audio_transcript.delta":
                    continue
                detail = ""
                if kind == "input_audio_buffer.speech_stopped":
                    speech_end_ms.append(event["audio_end_ms"])
                    detail = f"audio_end_ms {event['audio_end_ms']}"
                elif kind == "input_audio_buffer.speech_started":
                    detail = f"audio_start_ms {event['audio_start_ms']}"
                elif kind == "response.created":
                    pending["responses"] += 1
                elif kind == "response.done":
                    pending["responses"] -= 1
                    detail = event["response"]["status"]
                elif kind == "response.output_audio_transcript.done":
                    detail = repr(event["transcript"][:60])
                elif kind == "error":
                    detail = f"{event['error'].get('code')}: {event['error'].get('message')}"
                stamp(kind, detail)

        recv_task = asyncio.create_task(receiver())
        await asyncio.wait_for(sender(), timeout_s)
        deadline = time.monotonic() + timeout_s
        while pending["responses"] > 0 and time.monotonic() < deadline and not recv_task.done():
            await asyncio.sleep(0.05)
        recv_task.cancel()
    return result


def write_wav(path: str | Path, pcm16: bytes) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm16)


def print_timeline(result: CallResult) -> None:
    print(f"{'t (s)':>8}  event")
    for t, kind, detail in result.timeline:
        print(f"{t:8.3f}  {kind}{'  ' + detail if detail else ''}")
    if result.ttfa_ms:
        print(f"TTFA (end of speech to first reply audio): {', '.join(f'{v:.0f} ms' for v in result.ttfa_ms)}")
    print(f"reply audio: {len(result.reply) / 2 / RATE:.2f} s")
