"""`tool_choice` through the official openai SDK against `duplex serve` with tiny-omni: a named
function and "required" make the reply a call of that tool (the random model would never write
one), reported as any call is; "auto" lets it answer in text."""


import pytest

from tests.transport.sdk import client_for, events_until

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "name": name, "parameters": {"type": "object"}}
         for name in ("get_weather", "get_time")]



async def test_tool_choice_makes_the_reply_a_call(server_process, tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))
    client = client_for(server)
    async with client.realtime.connect(model="tiny") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "tools": TOOLS, "output_modalities": ["text"], "temperature": 0,
            "audio": {"input": {"turn_detection": None}}})
        await events_until(conn, "session.updated")
        await conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "what is the time in Oslo?"}]})

        async def reply(tool_choice):
            await conn.response.create(response={"tool_choice": tool_choice,
                                                 "max_output_tokens": 80,
                                                 "conversation": "none"})
            events = await events_until(conn, "response.done")
            assert "error" not in [e.type for e in events]
            return events

        events = await reply({"type": "function", "name": "get_weather"})
        output = events[-1].response.output
        calls = [i for i in output if i.type == "function_call"]
        assert [c.name for c in calls] == ["get_weather"]
        # The reply's message item opens before its first token; the call leaves it empty.
        assert [i.content[0].text for i in output if i.type == "message"] in ([], [""])
        assert events[-1].response.status == "completed"
        types = [e.type for e in events]
        assert "response.function_call_arguments.done" in types
        assert "response.output_text.delta" not in types, "no part of the call is written out"

        events = await reply("required")
        [call] = [i for i in events[-1].response.output if i.type == "function_call"]
        assert call.name in ("get_weather", "get_time")

        events = await reply("auto")
        [said] = events[-1].response.output
        assert said.type == "message" and said.content[0].text
