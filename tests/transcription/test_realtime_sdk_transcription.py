"""Input transcription as a client sees it: the official openai SDK against `duplex serve`
asks for `whisper-1`, speaks the fixtures one turn each, and reads each turn's transcript from
the transcription events and from `conversation.item.retrieve`."""

import asyncio
import base64
import os

import numpy as np
import pytest
import soxr

from tests.transcription.fixtures import RATE as FIXTURE_RATE
from tests.transcription.test_whisper import MAX_WER
from tests.transcription.wer import word_error_rate
from tests.transport.sdk import client_for
from tests.transport.test_realtime_sdk import append_paced

pytestmark = pytest.mark.slow

WIRE_RATE = 24000
DONE = ("conversation.item.input_audio_transcription.completed",
        "conversation.item.input_audio_transcription.failed")


def pcm16(pcm: np.ndarray) -> bytes:
    """Fixture audio as the wire carries it: PCM16 at 24 kHz."""
    wire = soxr.resample(pcm, FIXTURE_RATE, WIRE_RATE)
    return (np.clip(wire, -1, 1) * 32767).astype("<i2").tobytes()


def pcm16_b64(pcm: np.ndarray) -> str:
    return base64.b64encode(pcm16(pcm)).decode()


async def events_until(conn, types: tuple[str, ...], timeout: float = 60.0) -> list:
    events = []

    async def run():
        async for event in conn:
            events.append(event)
            if event.type in types:
                return

    await asyncio.wait_for(run(), timeout)
    return events


async def test_spoken_turns_come_back_transcribed_through_the_sdk(server_process, utterances):
    # The whole fixture set is sent faster than it would be spoken; the input lead allows it.
    server = server_process("--model", "echo",
                            env={**os.environ, "DUPLEX_REALTIME__MAX_INPUT_LEAD_MS": "120000"})
    client = client_for(server)
    hypotheses, item_ids = [], []
    async with client.realtime.connect(model="echo") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            "turn_detection": None, "transcription": {"model": "whisper-1"}}}})
        [updated] = await events_until(conn, ("session.updated",))
        assert updated.session.audio.input.transcription.model == "whisper-1"
        for utterance in utterances:
            await conn.input_audio_buffer.append(audio=pcm16_b64(utterance.pcm))
            await conn.input_audio_buffer.commit()
            events = await events_until(conn, DONE)
            types = [e.type for e in events]
            assert "error" not in types, events
            [committed] = [e for e in events if e.type == "input_audio_buffer.committed"]
            done = events[-1]
            assert done.type == DONE[0], done
            assert (done.item_id, done.content_index) == (committed.item_id, 0)
            deltas = [e for e in events
                      if e.type == "conversation.item.input_audio_transcription.delta"]
            assert deltas and all(d.item_id == committed.item_id for d in deltas)
            assert "".join(d.delta for d in deltas) == done.transcript
            hypotheses.append(done.transcript)
            item_ids.append(committed.item_id)

        references = [u.text for u in utterances]
        wer = word_error_rate(references, hypotheses)
        report = "\n".join(f"  {r!r} -> {h!r}" for r, h in zip(references, hypotheses, strict=True))
        print(f"\nWER through the server {wer:.3f}\n{report}")
        assert wer < MAX_WER, report

        # The transcript stays on the user's item.
        for item_id, transcript in zip(item_ids, hypotheses, strict=True):
            await conn.conversation.item.retrieve(item_id=item_id)
            [retrieved] = await events_until(conn, ("conversation.item.retrieved",))
            assert retrieved.item.id == item_id and retrieved.item.role == "user"
            assert retrieved.item.content[0].transcript == transcript


async def test_a_transcription_session_captions_each_turn_live_and_never_replies(
        server_process, utterances):
    """`?intent=transcription`, as LiveKit's realtime STT connects: server VAD ends each turn,
    partial deltas come while the user speaks and add up to the completed transcript, and
    nothing ever answers."""
    server = server_process("--model", "echo")
    client = client_for(server)
    silence = np.zeros(FIXTURE_RATE, np.float32)
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        created = await conn.recv()
        assert created.session.type == "transcription"
        # A second of silence ends a turn: the pauses between the fixture's sentences do not.
        await conn.session.update(session={"type": "transcription", "audio": {"input": {
            "transcription": {"model": "gpt-4o-mini-transcribe", "language": "en"},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 1000}}}})
        [updated] = await events_until(conn, ("session.updated",))
        assert updated.session.audio.input.transcription.model == "gpt-4o-mini-transcribe"
        # Two turns: the first (one sentence) loads the recogniser, the second (three) is
        # captioned while it is said.
        first, *rest = utterances[:4]
        said = " ".join(u.text for u in rest)
        for pcm in (first.pcm, np.concatenate([u.pcm for u in rest])):
            # Paced as a microphone sends it, 100 ms at a time.
            await append_paced(conn, pcm16(np.concatenate([silence, pcm, silence, silence])))
            events = await events_until(conn, DONE, 120)
        types = [e.type for e in events]
        assert "error" not in types and not any(t.startswith("response.") for t in types), types
        done = events[-1]
        assert done.type == DONE[0]
        deltas = [e for e in events
                  if e.type == "conversation.item.input_audio_transcription.delta"]
        # Live captions: words came while the turn was still going on, before its commit.
        committed = types.index("input_audio_buffer.committed")
        assert any(e.type == deltas[0].type for e in events[:committed]), types
        assert len(deltas) >= 2 and "".join(d.delta for d in deltas) == done.transcript
        assert word_error_rate([said], [done.transcript]) < MAX_WER
        await conn.response.create()
        [error] = await events_until(conn, ("error",))
        assert "transcription session" in error.error.message


async def test_any_transcription_model_name_is_served_and_echoed(server_process):
    server = server_process("--model", "echo")
    client = client_for(server)
    names = ["whisper-1", "gpt-transcribe", "gpt-live-transcribe", "gpt-4o-mini-transcribe",
             "gpt-4o-mini-transcribe-2025-12-15", "gpt-4o-transcribe",
             "gpt-4o-transcribe-diarize", "gpt-realtime-whisper", "whisper-tiny.en",
             "my-own-asr"]
    async with client.realtime.connect(model="echo") as conn:
        assert (await conn.recv()).type == "session.created"
        for name in names:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {
                "transcription": {"model": name, "prompt": "Weather, cities."}}}})
            [updated] = await events_until(conn, ("session.updated", "error"))
            assert updated.type == "session.updated", updated
            assert updated.session.audio.input.transcription.model == name
        # The embedded recogniser is English only: another language names what it does.
        await conn.session.update(session={"type": "realtime", "audio": {"input": {
            "transcription": {"model": "whisper-1", "language": "fr"}}}})
        [error] = await events_until(conn, ("error",))
        assert error.error.param == "session.audio.input.transcription.language"
        assert "'fr'" in error.error.message and "en" in error.error.message
