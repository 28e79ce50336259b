"""The official openai SDK as a client of `duplex serve` (echo model, a real subprocess)."""

import asyncio
import base64

import numpy as np
import pytest

from duplex.bench.synth import babble
from tests.transport.sdk import client_for, events_until

RATE = 24000


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()




async def append_paced(conn, audio: bytes, chunk_ms=100):
    step = RATE * 2 * chunk_ms // 1000
    for i in range(0, len(audio), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + step]).decode())
        await asyncio.sleep(chunk_ms / 1000 * 0.9)


async def use_manual_turns(conn):
    await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
    updated = await conn.recv()
    assert updated.type == "session.updated"


async def take_turn(conn, audio: bytes, timeout=20.0):
    """Say `audio`, commit it, ask for a reply; the events up to response.done."""
    await append_paced(conn, audio)
    await conn.input_audio_buffer.commit()
    await conn.response.create()
    return await events_until(conn, "response.done", timeout)


def reply_audio(events) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


@pytest.fixture
def echo_server(server_process):
    return server_process("--model", "echo")


@pytest.mark.slow
async def test_manual_turn_returns_the_input_exactly(echo_server):
    audio = pcm16(babble(RATE * 3 // 4, seed=3))
    async with client_for(echo_server).realtime.connect(model="echo") as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.id.startswith("sess_")
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.audio.input.turn_detection is None
        events = await take_turn(conn, audio)
    types = [e.type for e in events]
    assert types[:3] == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    assert types.index("response.created") < types.index("response.output_audio.delta")
    assert types[-6:] == [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert events[-1].response.status == "completed"
    assert reply_audio(events) == audio
    transcript = events[-5].transcript
    assert transcript.startswith("frame0 frame1") and transcript == "".join(
        e.delta for e in events if e.type == "response.output_audio_transcript.delta"
    )
    ids = [e.event_id for e in events]
    assert len(set(ids)) == len(ids)


@pytest.mark.slow
async def test_server_vad_turn_then_barge_in_cancels_within_a_frame(echo_server):
    speech = babble(RATE * 3, seed=5)
    silence = np.zeros(RATE, np.float32)
    async with client_for(echo_server).realtime.connect(model="echo") as conn:
        await conn.recv()
        await append_paced(conn, pcm16(np.concatenate([silence[: RATE // 2], speech, silence])))
        events = await events_until(conn, "response.output_audio.delta")
        types = [e.type for e in events]
        assert "input_audio_buffer.speech_started" in types
        assert "input_audio_buffer.speech_stopped" in types
        started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
        # Speech begins at 500 ms; the decision lands within ~100 ms and audio_start_ms
        # reaches back by the default 300 ms of prefix padding.
        assert 200 <= started.audio_start_ms <= 400
        # Talk over the reply: the server must cancel it and stop its audio.
        barge = asyncio.create_task(append_paced(conn, pcm16(np.concatenate([speech[:RATE], silence]))))
        events = await events_until(conn, "output_audio_buffer.cleared")
        await barge
        types = [e.type for e in events]
        done = next(e for e in events if e.type == "response.done")
        assert done.response.status == "cancelled"
        assert done.response.status_details.reason == "turn_detected"
        assert types.index("input_audio_buffer.speech_started") < types.index("response.done")
        response_id = done.response.id
        after = await events_until(conn, "input_audio_buffer.speech_stopped")
        assert not [
            e for e in after if e.type == "response.output_audio.delta" and e.response_id == response_id
        ]


@pytest.mark.slow
async def test_truncate_keeps_only_what_was_heard(echo_server):
    audio = pcm16(babble(RATE * 2, seed=7))
    async with client_for(echo_server).realtime.connect(model="echo") as conn:
        await conn.recv()
        await use_manual_turns(conn)
        events = await take_turn(conn, audio)
        item_id = next(e for e in events if e.type == "response.output_item.added").item.id
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=500)
        truncated = await conn.recv()
        assert truncated.type == "conversation.item.truncated"
        assert (truncated.item_id, truncated.audio_end_ms) == (item_id, 500)
        await conn.send({"type": "conversation.item.retrieve", "item_id": item_id})
        retrieved = await conn.recv()
        # 500 ms is 12000 samples: frames 0..6 of 1920 samples started before it.
        assert retrieved.item.content[0].transcript == "".join(f"frame{i} " for i in range(7))
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=60_000)
        error = await conn.recv()
        assert error.type == "error" and error.error.param == "audio_end_ms"


@pytest.mark.slow
async def test_two_sessions_never_see_each_others_events_or_audio(echo_server):
    async def one_session(seed):
        audio = pcm16(babble(RATE // 2, seed=seed))
        async with client_for(echo_server).realtime.connect(model="echo") as conn:
            created = await conn.recv()
            await use_manual_turns(conn)
            events = await take_turn(conn, audio)
            return created.session.id, audio, events

    (id_a, audio_a, ev_a), (id_b, audio_b, ev_b) = await asyncio.gather(one_session(1), one_session(2))
    assert id_a != id_b
    assert reply_audio(ev_a) == audio_a and reply_audio(ev_b) == audio_b
    items_a = {e.item_id for e in ev_a if hasattr(e, "item_id")}
    items_b = {e.item_id for e in ev_b if hasattr(e, "item_id")}
    assert items_a and items_b and not items_a & items_b


@pytest.mark.slow
async def test_tiny_omni_answers_a_full_turn(server_process, tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))
    async with client_for(server).realtime.connect(model="tiny-omni") as conn:
        created = await conn.recv()
        assert created.session.model == str(tiny_omni_dir)
        await use_manual_turns(conn)
        events = await take_turn(conn, pcm16(babble(RATE, seed=9)), timeout=60)
    assert events[-1].response.status == "completed"
    audio = np.frombuffer(reply_audio(events), dtype="<i2")
    # The tiny checkpoint is forced to speak 25-50 codec frames of 80 ms.
    assert 2 * RATE <= len(audio) <= 4 * RATE + RATE // 10
    assert np.abs(audio).max() > 100
    deltas = [e.delta for e in events if e.type == "response.output_audio_transcript.delta"]
    done = next(e for e in events if e.type == "response.output_audio_transcript.done")
    assert deltas and done.transcript == "".join(deltas)


@pytest.mark.slow
async def test_tiny_moshi_answers_a_full_turn(server_process, tiny_moshi_dir):
    server = server_process("--model", str(tiny_moshi_dir))
    async with client_for(server).realtime.connect(model="tiny-moshi") as conn:
        await conn.recv()
        await use_manual_turns(conn)
        events = await take_turn(conn, pcm16(babble(RATE, seed=10)), timeout=60)
    assert events[-1].response.status == "completed"
    audio = np.frombuffer(reply_audio(events), dtype="<i2")
    assert len(audio) >= 4 * 1920 and np.abs(audio).max() > 0
