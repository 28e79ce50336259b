"""What a session asks reaches the model, through the official openai SDK against `duplex serve`:
a tool round trip with the echo oracle, instructions and greedy sampling with tiny-omni, a
text-only reply that runs no Talker, voices, and errors after which the session goes on."""

import asyncio
import base64
import json
import os
import re
import shutil

import httpx
import pytest

from models.qwen3_omni.tiny import OPTIONS_FILE
from tests.transport.sdk import client_for, events_until
from tests.waiting import eventually

pytestmark = pytest.mark.slow




async def configure(conn, **session):
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session={"type": "realtime",
                                       "audio": {"input": {"turn_detection": None}}, **session})
    updated = await events_until(conn, "session.updated")
    return updated[-1]


async def say(conn, text: str, **response):
    await conn.conversation.item.create(item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await conn.response.create(**({"response": response} if response else {}))
    return await events_until(conn, "response.done")


def stage_calls(server) -> dict[str, float]:
    """Batched calls per stage so far, as /metrics reports them."""
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(r'duplex_stage_compute_seconds_count\{stage="(\w+)"\} (\S+)', text)
    return {stage: float(n) for stage, n in found}


async def test_a_tool_round_trip_with_the_echo_oracle(server_process):
    server = server_process("--model", "echo")
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    async with client_for(server).realtime.connect(model="echo") as conn:
        updated = await configure(conn, tools=tools, tool_choice="auto")
        assert [t.name for t in updated.session.tools] == ["get_weather"]
        # The echo model says what it was told: here, a call of the tool.
        events = await say(conn, 'Checking. <tool_call>{"name": "get_weather", '
                                 '"arguments": {"city": "Paris"}}</tool_call>')
        types = [e.type for e in events]
        assert "error" not in types
        done = events[-1].response
        call = next(i for i in done.output if i.type == "function_call")
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
        spoken = "".join(e.delta for e in events
                         if e.type == "response.output_audio_transcript.delta")
        assert "tool_call" not in spoken and spoken.strip() == "Checking."
        assert types.index("response.function_call_arguments.done") < types.index("response.done")
        # The client runs the tool and answers; the model speaks the answer.
        await conn.conversation.item.create(item={
            "type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."})
        await conn.response.create()
        events = await events_until(conn, "response.done")
        assert "error" not in [e.type for e in events]
        transcript = "".join(e.delta for e in events
                             if e.type == "response.output_audio_transcript.delta")
        assert transcript == "Sunny, 21 C."
        assert any(e.type == "response.output_audio.delta" for e in events)


async def test_greedy_replies_follow_the_instructions(server_process, tiny_omni_dir):
    env = {**os.environ, "DUPLEX_CACHES__PREFIX_BYTES": "50000000"}
    server = server_process("--model", str(tiny_omni_dir), env=env)

    def lookups() -> tuple[str, str]:
        """The prefix cache's (hits, misses) on /metrics."""
        text = httpx.get(f"{server.url}/metrics").text
        return tuple(re.search(rf"^duplex_prefix_cache_{name}_total (\S+)$", text, re.M).group(1)
                     for name in ("hits", "misses"))

    async def reply(instructions: str) -> tuple[str, tuple[str, str]]:
        """The reply's text, and the cache's lookups on /metrics as soon as it is done."""
        async with client_for(server).realtime.connect(model="tiny") as conn:
            await configure(conn, instructions=instructions, output_modalities=["text"],
                            temperature=0)
            events = await say(conn, "hello, who are you?")
            assert events[-1].response.status == "completed"
            return ("".join(e.delta for e in events if e.type == "response.output_text.delta"),
                    lookups())

    # Greedy: the same context gives the same reply, whatever the session.
    (first, seen1), (again, seen2) = await reply("You are a pirate."), await reply(
        "You are a pirate.")
    other, seen3 = await reply("You are a lawyer who answers in French.")
    assert first == again and first
    assert other != first
    # The second pirate's context opened with the first's system turn, from the prefix cache;
    # /metrics counts each session's lookup as soon as its reply is done.
    assert [seen1, seen2, seen3] == [("0.0", "1.0"), ("1.0", "1.0"), ("1.0", "2.0")]
    text = httpx.get(f"{server.url}/metrics").text
    assert "duplex_prefix_cache_budget_bytes 5e+07" in text


async def test_a_text_only_reply_has_no_audio_and_runs_no_talker(server_process, tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))
    async with client_for(server).realtime.connect(model="tiny") as conn:
        await configure(conn)
        events = await say(conn, "in text", output_modalities=["text"], max_output_tokens=5)
        assert not [e for e in events if "audio" in e.type]
        assert any(e.type == "response.output_text.done" for e in events)
        done = events[-1].response
        assert done.output[0].content[0].type == "output_text"
    # The engine reports its steps a little later; the Thinker's are seen once they come, and
    # no Talker or codec step was ever planned for this server's only reply.
    calls = await eventually(lambda: (c := stage_calls(server)).get("thinker") and c,
                             "the Thinker's steps reach /metrics")
    assert "talker" not in calls and "codec" not in calls


async def test_truncation_reaches_the_model_and_response_done_reports_it(
        server_process, tiny_omni_dir, tmp_path):
    """A checkpoint whose Thinker keeps 256 positions: with truncation disabled the turn
    that no longer fits fails with context_length_exceeded; switched to a retention ratio,
    the same session answers again and its usage says how much of the context went."""
    model = tmp_path / "tiny-omni-short-context"
    shutil.copytree(tiny_omni_dir, model)
    options = model / OPTIONS_FILE
    options.write_text(json.dumps({**json.loads(options.read_text()), "max_context": 256}))
    server = server_process("--model", str(model))
    async with client_for(server).realtime.connect(model="tiny") as conn:
        updated = await configure(conn, truncation="disabled", output_modalities=["text"])
        assert updated.session.truncation == "disabled"
        done = []
        while len(done) < 10 and (not done or done[-1].status == "completed"):
            events = await say(conn, "tell me about the sea and the ships that sail on it")
            done.append(events[-1].response)
        *fitted, refused = done
        assert fitted and all(d.usage.model_extra["truncation"] == {
            "type": "disabled", "truncated_tokens": 0} for d in fitted)
        assert refused.status == "failed"
        assert refused.status_details.error.code == "context_length_exceeded"

        await conn.session.update(session={"type": "realtime", "truncation": {
            "type": "retention_ratio", "retention_ratio": 0.5}})
        await events_until(conn, "session.updated")
        events = await say(conn, "and the ports?")
        answer = events[-1].response
        assert answer.status == "completed"
        truncation = answer.usage.model_extra["truncation"]
        assert truncation["type"] == "retention_ratio" and truncation["truncated_tokens"] > 0
        assert answer.usage.input_tokens <= 256


async def test_voices_are_checked_and_errors_leave_the_session_going(server_process,
                                                                   tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))
    async with client_for(server).realtime.connect(model="tiny") as conn:
        updated = await configure(conn, audio={"input": {"turn_detection": None},
                                               "output": {"voice": "chelsie"}})
        assert updated.session.audio.output.voice == "chelsie"
        await conn.session.update(session={"type": "realtime",
                                           "audio": {"output": {"voice": "nobody"}}})
        [error] = await events_until(conn, "error")
        assert (error.error.code, error.error.param) == ("invalid_value",
                                                         "session.audio.output.voice")
        assert "aiden, chelsie, ethan" in error.error.message
        events = await say(conn, "speak")
        assert any(e.type == "response.output_audio.delta" for e in events)
        await conn.session.update(session={"type": "realtime",
                                           "audio": {"output": {"voice": "aiden"}}})
        [error] = await events_until(conn, "error")
        assert error.error.code == "cannot_update_voice"
        events = await say(conn, "still here", output_modalities=["text"], max_output_tokens=3)
        assert events[-1].response.status == "incomplete"
        assert events[-1].response.status_details.reason == "max_output_tokens"


async def test_greedy_audio_is_the_same_in_one_voice_and_differs_in_another(server_process,
                                                                            tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))

    async def audio(voice: str) -> bytes:
        async with client_for(server).realtime.connect(model="tiny") as conn:
            await configure(conn, temperature=0, audio={"input": {"turn_detection": None},
                                                        "output": {"voice": voice}})
            events = await say(conn, "speak")
            assert events[-1].response.status == "completed"
            return b"".join(base64.b64decode(e.delta) for e in events
                            if e.type == "response.output_audio.delta")

    # Each session samples with generators of its own; greedy, none of them is drawn from.
    ethan, again, chelsie = await audio("ethan"), await audio("ethan"), await audio("chelsie")
    assert ethan and ethan == again
    assert chelsie and chelsie != ethan


async def test_per_stage_timings_come_only_to_clients_that_ask(server_process):
    import websockets

    server = server_process("--model", "echo")
    base = server.url.replace("http", "ws") + "/v1/realtime"
    audio = base64.b64encode(bytes(2 * 24000 // 2)).decode()

    async def event_types(url: str) -> list[str]:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            seen = []
            while not seen or seen[-1] != "response.done":
                seen.append(json.loads(await asyncio.wait_for(ws.recv(), 20))["type"])
            return seen

    assert "duplex.response.timings" not in await event_types(base)
    assert "duplex.response.timings" in await event_types(base + "?duplex_events=1")
