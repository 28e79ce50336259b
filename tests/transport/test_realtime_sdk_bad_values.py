"""Every new field of a session and of a reply, given a bad value through the official openai
SDK against `duplex serve`: each is answered with one error naming the field, nothing starts,
and the session goes on."""

import asyncio

import pytest

from tests.transport.sdk import client_for

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}

BAD_SESSION = [
    ({"instructions": 5}, "session.instructions"),
    ({"temperature": 3}, "session.temperature"),
    ({"temperature": "hot"}, "session.temperature"),
    ({"max_output_tokens": 0}, "session.max_output_tokens"),
    ({"max_output_tokens": 5000}, "session.max_output_tokens"),
    ({"max_output_tokens": "lots"}, "session.max_output_tokens"),
    ({"output_modalities": ["video"]}, "session.output_modalities.0"),
    ({"output_modalities": ["text", "audio"]}, "session.output_modalities"),
    ({"tools": "all"}, "session.tools"),
    ({"tools": [{"type": "computer", "name": "x"}]}, "session.tools.0"),
    ({"tools": [{"type": "mcp", "name": "x"}]}, "session.tools.0.server_label"),
    ({"tools": [{"type": "mcp", "server_label": "x", "connector_id": "connector_gmail"}]},
     "session.tools.0.server_url"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "session.tools.0.name"),
    ({"tools": [{**TOOL, "parameters": "x"}]}, "session.tools.0.parameters"),
    ({"tool_choice": "sometimes"}, "session.tool_choice"),
    ({"tool_choice": {"type": "function", "name": "missing"}}, "session.tool_choice.name"),
    ({"truncation": "sometimes"}, "session.truncation"),
    ({"audio": {"output": {"voice": "nobody"}}}, "session.audio.output.voice"),
    ({"audio": {"input": {"transcription": {"model": "whisper-1", "language": 5}}}},
     "session.audio.input.transcription.language"),
    ({"audio": {"input": {"transcription": {"model": "whisper-1", "prompt": 5}}}},
     "session.audio.input.transcription.prompt"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
     "session.audio.input.turn_detection.eagerness"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 10}}}},
     "session.audio.input.turn_detection.idle_timeout_ms"),
]

BAD_RESPONSE = [
    ({"instructions": 5}, "response.instructions"),
    ({"max_output_tokens": 0}, "response.max_output_tokens"),
    ({"output_modalities": ["video"]}, "response.output_modalities.0"),
    ({"output_modalities": ["audio", "text"]}, "response.output_modalities"),
    ({"conversation": "elsewhere"}, "response.conversation"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "response.tools.0.name"),
    ({"tool_choice": "sometimes"}, "response.tool_choice"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "response.tool_choice.name"),
    ({"audio": {"output": {"voice": "nobody"}}}, "response.audio.output.voice"),
    ({"metadata": {"k": "v" * 513}}, "response.metadata.k"),
]


async def next_of(conn, types: tuple[str, ...], seen: list, timeout: float = 20.0):
    async def run():
        async for event in conn:
            seen.append(event)
            if event.type in types:
                return event

    return await asyncio.wait_for(run(), timeout)


async def test_every_bad_value_is_named_and_the_session_goes_on(server_process):
    server = server_process("--model", "echo")
    client = client_for(server)
    seen: list = []
    async with client.realtime.connect(model="echo") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "tools": [TOOL],
                                           "audio": {"input": {"turn_detection": None}}})
        good = await next_of(conn, ("session.updated", "error"), seen)
        assert good.type == "session.updated"

        for session, param in BAD_SESSION:
            await conn.session.update(session={"type": "realtime", **session})
            error = await next_of(conn, ("error", "session.updated"), seen)
            assert error.type == "error", (session, error)
            assert (error.error.code, error.error.param) == ("invalid_value", param), session
        for response, param in BAD_RESPONSE:
            await conn.response.create(response=response)
            error = await next_of(conn, ("error", "response.created"), seen)
            assert error.type == "error", (response, error)
            assert error.error.param == param, response

        # Nothing bad took hold: the session is as it was, and it still answers.
        await conn.session.update(session={"type": "realtime"})
        updated = await next_of(conn, ("session.updated",), seen)
        assert [t.name for t in updated.session.tools] == ["get_weather"]
        assert updated.session.audio.output.voice != "nobody"
        assert updated.session.audio.input.transcription is None
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "ok"}]})
        await conn.response.create()
        done = await next_of(conn, ("response.done",), seen)
        assert done.response.status == "completed"
    assert [e.type for e in seen].count("error") == len(BAD_SESSION) + len(BAD_RESPONSE)
