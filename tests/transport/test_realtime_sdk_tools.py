"""Tool calls through the official openai SDK against `duplex serve --model echo` (whose reply
to a text is that text, parsed as a model's is): a reply that speaks and then calls two tools,
and a call that is not JSON."""

import json

import httpx
import pytest

from tests.transport.sdk import client_for, events_until

pytestmark = pytest.mark.slow



async def test_a_reply_speaks_then_calls_two_tools_and_hears_both_outputs(server_process):
    server = server_process("--model", "echo")
    client = client_for(server)
    tools = [{"type": "function", "name": name, "parameters": {"type": "object"}}
             for name in ("get_weather", "get_time")]
    async with client.realtime.connect(model="echo") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "tools": tools,
                                           "audio": {"input": {"turn_detection": None}}})
        await events_until(conn, "session.updated")
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": (
                'One moment. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
                "</tool_call>")}]})
        await conn.response.create()
        events = await events_until(conn, "response.done")
        assert "error" not in [e.type for e in events]

        output = events[-1].response.output
        assert [i.type for i in output] == ["message", "function_call", "function_call"]
        assert output[0].content[0].transcript.strip() == "One moment."
        calls = output[1:]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
        assert len({c.call_id for c in calls}) == 2
        # Each call's arguments stream under its own item, in output order.
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [(e.item_id, e.output_index) for e in done] == [(c.id, i + 1)
                                                              for i, c in enumerate(calls)]
        spoken = "".join(e.delta for e in events
                         if e.type == "response.output_audio_transcript.delta")
        assert "tool_call" not in spoken

        for call, result in zip(calls, ("Sunny.", "Noon."), strict=True):
            await conn.conversation.item.create(item={
                "type": "function_call_output", "call_id": call.call_id, "output": result})
        await conn.response.create()
        events = await events_until(conn, "response.done")
        transcript = "".join(e.delta for e in events
                             if e.type == "response.output_audio_transcript.delta")
        assert events[-1].response.status == "completed"
        assert "Sunny." in transcript and "Noon." in transcript


async def test_a_call_that_is_not_json_is_reported_raw_and_counted(server_process):
    server = server_process("--model", "echo")
    client = client_for(server)
    async with client.realtime.connect(model="echo") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime",
                                           "audio": {"input": {"turn_detection": None}}})
        await events_until(conn, "session.updated")
        await conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "<tool_call>call lookup now</tool_call>"}]})
        await conn.response.create()
        events = await events_until(conn, "response.done")
    [call] = [i for i in events[-1].response.output if i.type == "function_call"]
    assert call.arguments == "call lookup now"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "\nduplex_tool_calls_invalid_total 1.0\n" in metrics
