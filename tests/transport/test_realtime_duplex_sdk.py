"""Native duplex through the official openai SDK against `duplex serve --model echo` (a real
subprocess): the echo's duplex mode repeats each session's input a frame later, so every
spoken segment a client gets back is exactly what it said, whatever its neighbours do."""

import asyncio
import base64

import httpx
import numpy as np
import pytest

from tests.transport.test_realtime_sdk import client_for, pcm16

RATE = 24000
FRAME = 1920
DUPLEX = {"type": "realtime", "audio": {"input": {"turn_detection": {
    "type": "duplex", "silence_duration_ms": 240}}}}


def burst(seed: int, frames: int) -> bytes:
    """Loud noise, whole model frames long: every frame of it is voiced."""
    rng = np.random.default_rng(seed)
    return pcm16(np.clip(0.3 * rng.standard_normal(frames * FRAME), -0.9, 0.9))


def silence(frames: int) -> bytes:
    return bytes(2 * frames * FRAME)


@pytest.fixture
def echo_server(server_process):
    return server_process("--model", "echo")


async def start_duplex(conn):
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session=DUPLEX)
    updated = await conn.recv()
    assert updated.type == "session.updated"
    assert updated.session.audio.input.turn_detection.type == "duplex"


async def append(conn, audio: bytes, chunk_ms: int = 100):
    step = RATE * 2 * chunk_ms // 1000
    for i in range(0, len(audio), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i : i + step]).decode())


async def responses(conn, count: int, timeout: float = 40.0):
    """`count` responses as (response.done, its audio), the event types seen, and the ids of
    every response that sent audio."""
    done, audio, seen = [], {}, []

    async def run():
        async for event in conn:
            seen.append(event.type)
            if event.type == "response.output_audio.delta":
                audio[event.response_id] = audio.get(event.response_id, b"") + \
                    base64.b64decode(event.delta)
            elif event.type == "response.done":
                done.append(event.response)
                if len(done) == count:
                    return

    await asyncio.wait_for(run(), timeout)
    return [(d, audio.get(d.id, b"")) for d in done], seen, set(audio)


@pytest.mark.slow
async def test_eight_concurrent_duplex_sessions_each_get_their_own_speech_back(echo_server):
    async def one(i: int):
        said = [burst(100 + i, 4 + i % 3), burst(200 + i, 3 + i % 2)]
        async with client_for(echo_server).realtime.connect(model="echo") as conn:
            await start_duplex(conn)
            await append(conn, silence(3 + i % 4) + said[0] + silence(6) + said[1] + silence(6))
            got, seen, _ = await responses(conn, 2)
        return said, got, seen

    for said, got, seen in await asyncio.gather(*(one(i) for i in range(8))):
        assert [d.status for d, _ in got] == ["completed", "completed"]
        assert [audio for _, audio in got] == said
        assert seen.count("response.created") == 2
        assert "error" not in seen


@pytest.mark.slow
async def test_a_cancelled_segment_stops_at_response_done_and_the_next_comes_whole(echo_server):
    async with client_for(echo_server).realtime.connect(model="echo") as conn:
        await start_duplex(conn)
        long_one, next_one = burst(1, 30), burst(2, 5)
        await append(conn, long_one + silence(6))
        async for event in conn:
            if event.type == "response.output_audio.delta":
                break
        await conn.response.cancel()
        after = []
        async for event in conn:
            after.append(event)
            if event.type == "response.done":
                assert event.response.status == "cancelled"
                break
        cancelled = after[-1].response.id
        # The model keeps talking (the rest of the long burst): none of it reaches the client.
        await append(conn, next_one + silence(6))
        got, seen, sounding = await responses(conn, 1)
        [(done, audio)] = got
        assert cancelled not in sounding
        assert done.id != cancelled and done.status == "completed"
        assert audio == next_one
        assert seen.count("response.created") == 1


@pytest.mark.slow
async def test_a_model_whose_default_mode_is_duplex_starts_every_session_in_it(server_process,
                                                                               tmp_path):
    config = tmp_path / "duplex.toml"
    config.write_text('[duplex]\ndefault_mode = { echo = "duplex" }\n')
    server = server_process("--model", "echo", "--config", str(config))
    health = httpx.get(f"{server.url}/healthz").json()
    assert health["duplex"] and health["duplex_default"]
    async with client_for(server).realtime.connect(model="echo") as conn:
        created = await conn.recv()
        assert created.session.audio.input.turn_detection.type == "duplex"
        said = burst(7, 4)
        # The default stretch of silence that ends a segment is 500 ms: seven frames.
        await append(conn, silence(2) + said + silence(8))
        got, _, _ = await responses(conn, 1)
        assert [audio for _, audio in got] == [said]


@pytest.mark.slow
async def test_tiny_moshi_in_duplex_speaks_as_frames_come_and_keeps_listening(server_process,
                                                                             tiny_moshi_dir):
    """The random-weight Moshi speaks from its first frames on (its audio is noise, its text
    random pieces): a response opens, audio and transcript deltas stream at real time, and a
    cancel ends it without closing the session."""
    from duplex.bench.synth import babble

    server = server_process("--model", str(tiny_moshi_dir))
    async with client_for(server).realtime.connect(model="tiny-moshi") as conn:
        await start_duplex(conn)
        await append(conn, pcm16(babble(RATE * 2, seed=5)))
        seen = []
        async for event in conn:
            seen.append(event.type)
            if seen.count("response.output_audio.delta") >= 3:
                break
        assert "response.created" in seen
        assert "response.output_audio_transcript.delta" in seen
        await conn.response.cancel()
        async for event in conn:
            if event.type == "response.done":
                assert event.response.status == "cancelled"
                break
        await conn.session.update(session={"type": "realtime", "instructions": "still here"})
        async for event in conn:
            if event.type == "session.updated":
                break


@pytest.mark.slow
async def test_duplex_asked_of_a_turn_based_model_is_an_error_and_the_session_goes_on(
        server_process, tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))
    async with client_for(server).realtime.connect(model="tiny-omni") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session=DUPLEX)
        error = await conn.recv()
        assert error.type == "error" and error.error.code == "invalid_value"
        assert error.error.param == "session.audio.input.turn_detection.type"
        assert "tiny-moshi" in error.error.message
        await conn.session.update(session={"type": "realtime", "instructions": "Be brief."})
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.audio.input.turn_detection.type == "server_vad"
        assert updated.session.instructions == "Be brief."
