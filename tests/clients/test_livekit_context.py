"""LiveKit Agents against `duplex serve` through its public APIs, for what it sends the model:
an agent handoff that replaces the chat history (`update_chat_ctx`: a system message, the
user's, the assistant's, a function call and its output), after which the reply follows the
new context exactly as a fresh session given it in one go; and `openai.STT` in its realtime
streaming mode, with interim transcripts while the user speaks."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import llm, stt, utils
from livekit.plugins import openai as lk_openai

from tests.clients.test_livekit import Client
from tests.transcription.fixtures import RATE as SPEECH_RATE
from tests.transcription.fixtures import speak
from tests.transcription.wer import word_error_rate

pytestmark = pytest.mark.slow

INSTRUCTIONS = "You help customers with their invoices."


def history() -> llm.ChatContext:
    ctx = llm.ChatContext()
    ctx.add_message(role="system", content="The customer is on the premium plan.", id="h_sys")
    ctx.add_message(role="user", content="My last invoice looks wrong.", id="h_user")
    ctx.add_message(role="assistant", content="Let me look it up for you.", id="h_said")
    ctx.items.append(llm.FunctionCall(id="h_call", call_id="call_lookup", name="lookup_invoice",
                                      arguments='{"number": 42}'))
    ctx.items.append(llm.FunctionCallOutput(id="h_out", call_id="call_lookup",
                                            name="lookup_invoice", output="Invoice 42: 30 EUR.",
                                            is_error=False))
    return ctx


def reply_text(c: Client, n: int) -> str:
    rid = c.wire.responses_done()[n - 1]["id"]
    return "".join(e["delta"] for e in c.wire.of("response.output_text.delta")
                   if e["response_id"] == rid)


def warnings_of(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.name.startswith("livekit") and r.levelno >= logging.WARNING]


@pytest.mark.timeout(200)
async def test_a_handoff_that_replaces_the_history_replies_from_the_new_context(
        server_process, tiny_omni_dir, kit, caplog):
    caplog.set_level(logging.WARNING)
    server = server_process("--model", str(tiny_omni_dir))
    server.model_kind = "tiny-omni"
    problems: list[str] = []
    async with Client(kit, server, text_only=True) as c:
        # The agent before the handoff talked with the user.
        ctx = c.rt.chat_ctx.copy()
        ctx.add_message(role="user", content="Hello, who am I speaking with?")
        await c.rt.update_chat_ctx(ctx)
        await c.reply(problems, "before the handoff")
        await c.done(1)
        # The handoff: the next agent's instructions, and a history that replaces the old.
        await c.rt.update_instructions(INSTRUCTIONS)
        await c.rt.update_chat_ctx(history())
        mirrored = [(i.type, i.id) for i in c.rt.chat_ctx.items]
        assert mirrored == [(i.type, i.id) for i in history().items]
        await c.reply(problems, "after the handoff")
        await c.done(2)
        handed = reply_text(c, 2)
    problems += c.problems()
    async with Client(kit, server, text_only=True) as fresh:
        await fresh.rt.update_instructions(INSTRUCTIONS)
        await fresh.rt.update_chat_ctx(history())
        await fresh.reply(problems, "fresh session")
        await fresh.done(1)
        laid_in_one_go = reply_text(fresh, 1)
    problems += fresh.problems() + warnings_of(caplog)
    assert not problems, kit.report(problems)
    assert handed and handed == laid_in_one_go


@pytest.mark.timeout(120)
async def test_livekit_realtime_stt_streams_interim_and_final_transcripts(server_process, kit,
                                                                          caplog):
    caplog.set_level(logging.WARNING)
    server = server_process("--model", "echo")
    text = "The meeting has been moved to Friday afternoon at three."
    pcm = speak(text)
    speech = np.concatenate([np.zeros(SPEECH_RATE // 2, np.float32), pcm,
                             np.zeros(2 * SPEECH_RATE, np.float32)])
    wire = (np.clip(utils_resample(speech), -1, 1) * 32767).astype(np.int16)
    got: list[stt.SpeechEvent] = []
    async with utils.http_context.open():
        recognizer = lk_openai.STT(model="gpt-4o-mini-transcribe", use_realtime=True,
                                   base_url=f"{server.url}/v1", api_key="sk-test")
        stream = recognizer.stream()

        async def read() -> None:
            async for event in stream:
                got.append(event)
                if event.type == stt.SpeechEventType.FINAL_TRANSCRIPT:
                    return

        reader = asyncio.create_task(read())

        def push(chunk: bytes) -> None:
            stream.push_frame(rtc.AudioFrame(data=chunk, sample_rate=kit.RATE, num_channels=1,
                                             samples_per_channel=len(chunk) // 2))

        # Paced as a microphone sends it, 50 ms at a time.
        await kit.stream(push, wire.tobytes(), chunk_ms=50)
        await asyncio.wait_for(reader, 60)
        stream.end_input()
        await stream.aclose()
        await recognizer.aclose()
    final = next(e for e in got if e.type == stt.SpeechEventType.FINAL_TRANSCRIPT)
    assert word_error_rate([text], [final.alternatives[0].text]) < 0.5, final
    kinds = [e.type for e in got]
    assert stt.SpeechEventType.START_OF_SPEECH in kinds
    assert not warnings_of(caplog)


def utils_resample(pcm: np.ndarray) -> np.ndarray:
    import soxr

    return soxr.resample(pcm, SPEECH_RATE, 24000).astype(np.float32)
