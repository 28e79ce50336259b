"""semantic_vad end to end: `duplex serve --model echo` with the real speech detector and the
real Smart Turn, a client that speaks recorded human speech in real time. A finished sentence
ends its turn at the pause, by the model; the same sentence cut at its middle pause waits for
eagerness's longest wait. The echo model's reply is what it heard of the turn: the turn's own
audio, from speech_started's audio_start_ms on."""

import re

import httpx
import numpy as np
import pytest
import websockets

from duplex.bench.prompts import prompts
from tests.transport.echoing_client import RATE, EchoingClient

HIGH_WAIT_S = 2.0
"""eagerness high: a turn the model does not judge complete ends after 2 s of silence."""


def ended(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    return {by: float(n) for by, n in re.findall(r'^duplex_turns_ended_total\{by="(\w+)"\} (\S+)$',
                                                 text, re.M)}


def heard_from(client: EchoingClient, reply: np.ndarray, start_ms: int) -> float:
    """How well the reply matches what the user said from `start_ms` (best lag within the
    millisecond the wire rounds to): 1.0 is the same audio."""
    base = start_ms * RATE // 1000
    n = min(len(reply), RATE * 2)
    best = 0.0
    for lag in range(0, RATE // 1000 + 1):
        said = client.user[base + lag : base + lag + n]
        denom = np.linalg.norm(said) * np.linalg.norm(reply[:n])
        if denom:
            best = max(best, float(np.dot(said, reply[:n]) / denom))
    return best


@pytest.mark.slow
async def test_a_finished_sentence_ends_at_the_pause_and_a_cut_one_waits(server_process):
    server = server_process("--model", "echo")
    by_name = {p.name: p for p in prompts(RATE)}
    finished, cut = by_name["vm-delete"], by_name["feature-not-avail-line"]
    url = server.url.replace("http", "ws") + "/v1/realtime?model=echo"
    async with websockets.connect(url, compression=None) as ws:
        c = EchoingClient(ws, delay_ms=0, gain_db=-300)
        await c.start()
        await c.send(type="session.update", session={"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}})
        before = ended(server)

        onset = c.say(finished.pcm, after_s=1.0)
        end = onset + len(finished.pcm) / RATE
        t_stop, _ = await c.wait_for("input_audio_buffer.speech_stopped")
        _, started = await c.wait_for("input_audio_buffer.speech_started")
        _, created = await c.wait_for("response.created", after=t_stop)
        await c.wait_for("response.done", after=t_stop)
        after_first = ended(server)
        assert after_first.get("model", 0) == before.get("model", 0) + 1
        assert t_stop - end < HIGH_WAIT_S
        # What the model heard is the turn's audio from audio_start_ms: no second of silence
        # before the sentence, and all of the sentence.
        reply = np.frombuffer(c.reply_audio(created["response"]["id"]), "<i2") / 32768
        assert heard_from(c, reply, started["audio_start_ms"]) > 0.99
        assert started["audio_start_ms"] / 1000 > onset - 0.35
        assert len(reply) >= len(finished.pcm)
        assert len(reply) / RATE < end - started["audio_start_ms"] / 1000 + 1.0

        head = cut.head
        onset = c.say(head, after_s=0.5)
        end = onset + len(head) / RATE
        t_stop, stopped = await c.wait_for("input_audio_buffer.speech_stopped", after=end)
        assert t_stop - end >= HIGH_WAIT_S
        assert ended(server).get("fallback", 0) == after_first.get("fallback", 0) + 1
        await c.stop()
