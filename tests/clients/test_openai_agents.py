"""The OpenAI Agents SDK's realtime agents (RealtimeRunner / RealtimeAgent) as a client of a
real `duplex serve`, driven only through the SDK's public API.

The SDK truncates the reply it is playing itself when the server reports speech_started
(agents/realtime/openai_realtime.py, _handle_ws_event). It validates every server event
against the openai package's models: one it cannot validate is logged as "Failed to
validate server event" and surfaces as an `error` session event, so both are checked along
with the `error` events the server sent.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

import pydantic
import pytest
from agents import HostedMCPTool, function_tool, set_tracing_disabled
from agents.realtime import (
    RealtimeAgent,
    RealtimeModelListener,
    RealtimeModelSendRawMessage,
    RealtimeModelSendToolOutput,
    RealtimeModelToolCallEvent,
    RealtimeRunner,
)

pytestmark = pytest.mark.slow

set_tracing_disabled(True)  # nothing may leave this machine

VALIDATION_FAILURE = "Failed to validate server event"


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"21 C and sunny in {city}"


def describe(error) -> str:
    """One line for an SDK error: the server's error, or which event failed validation."""
    if isinstance(error, pydantic.ValidationError):
        first = error.errors()[0]
        kind = first["input"].get("type") if isinstance(first["input"], dict) else None
        return f"validation of server event {kind!r} failed: {first['msg'][:120]}"
    return str(error).splitlines()[0]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().splitlines()[0])


class Client(RealtimeModelListener):
    """One SDK session and what came of it: raw server events from a model listener, audio
    and errors from the session's own event stream, the SDK's error log."""

    def __init__(self, kit, server, text_only: bool = False) -> None:
        self.kit = kit
        self.model_kind = server.model_kind
        self.wire = kit.Wire()
        self.audio: dict[str, int] = {}
        self.texts: dict[str, str] = {}
        self.session_errors: list[str] = []
        self.log = _Records()
        agent = RealtimeAgent(name="assistant", instructions="Answer briefly.",
                              tools=[get_weather])
        settings = {"turn_detection": {"type": "server_vad", "create_response": True,
                                       "interrupt_response": True}}
        if text_only:
            settings["output_modalities"] = ["text"]
        self.runner = RealtimeRunner(agent, config={"model_settings": settings})
        self.model_config = {
            "url": server.url.replace("http", "ws", 1) + f"/v1/realtime?model={server.model_kind}",
            "api_key": "sk-test",
        }
        self.session = None
        self._consumer: asyncio.Task | None = None

    async def on_event(self, event) -> None:  # RealtimeModelListener
        if event.type == "raw_server_event":
            self.wire.add(event.data)
        elif event.type in ("output_text_delta", "transcript_delta"):
            self.texts[event.response_id] = self.texts.get(event.response_id, "") + event.delta

    async def _consume(self) -> None:
        async for event in self.session:
            if event.type == "audio":
                rid = event.audio.response_id
                self.audio[rid] = self.audio.get(rid, 0) + len(event.audio.data)
            elif event.type == "error":
                self.session_errors.append(describe(event.error))

    async def __aenter__(self) -> Client:
        logging.getLogger("openai.agents").addHandler(self.log)
        self.session = await self.runner.run(model_config=self.model_config)
        self.session.model.add_listener(self)
        await self.session.__aenter__()
        self._consumer = asyncio.create_task(self._consume())
        await self.kit.wait_until(lambda: self.wire.count("session.updated") >= 1, 10,
                                  "session.updated", self.wire)
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.session.close()
            await asyncio.wait_for(self._consumer, 5)
        finally:
            logging.getLogger("openai.agents").removeHandler(self.log)

    async def say(self, pcm: bytes) -> None:
        await self.kit.stream(self.session.send_audio, pcm)

    def heard(self, response_id: str) -> int:
        return self.audio.get(response_id, 0)

    def text(self, response_id: str) -> int:
        return len(self.texts.get(response_id, ""))

    def truncate_sent(self, item_id: str) -> None:
        return None  # the SDK sends it from inside its event handler; the server's answer tells

    def done(self, n: int, timeout: float = 30):
        return self.kit.wait_until(lambda: len(self.wire.responses_done()) >= n, timeout,
                                   f"response.done #{n}", self.wire)

    def problems(self) -> list[str]:
        out = self.kit.error_lines(self.wire)
        out += [f"SDK logged: {m}" for m in self.log.messages if m.startswith(VALIDATION_FAILURE)]
        out += [f"SDK error session event: {e}" for e in self.session_errors]
        return out


async def text_and_tool(c: Client, problems: list[str]) -> None:
    problems += c.kit.session_config_problems(c.wire, tools=["get_weather"], voice="ash",
                                              transcription=True)

    # A text turn: session.send_message puts in a user text item and asks for a response.
    await c.session.send_message("What is the weather in Paris?")
    await c.done(1)
    text_reply = c.wire.responses_done()[0]
    if text_reply["status"] != "completed":
        problems.append(f"text turn: the reply ended {text_reply['status']}")
    elif c.model_kind != "echo":  # echo has heard nothing to say back
        await c.kit.wait_until(lambda: c.heard(text_reply["id"]) > 0, 5,
                               "the text reply's audio in the SDK", c.wire)

    # A tool result: the call it answers (as a restored conversation holds it), then the
    # model's tool-output path (what the session runs after a function tool), which also
    # asks for a response.
    call = RealtimeModelToolCallEvent(name="get_weather", call_id="call_weather_1",
                                      arguments='{"city": "Paris"}')
    await c.session.model.send_event(RealtimeModelSendRawMessage(message={
        "type": "conversation.item.create",
        "other_data": {"item": {"type": "function_call", "call_id": call.call_id,
                                "name": call.name, "arguments": call.arguments}},
    }))
    await c.session.model.send_event(RealtimeModelSendToolOutput(
        tool_call=call, output="21 C and sunny in Paris", start_response=True))
    await c.done(2)
    added = [e["item"] for e in c.wire.of("conversation.item.added")]
    for kind in ("function_call", "function_call_output"):
        if not any(i.get("type") == kind and i.get("call_id") == call.call_id for i in added):
            problems.append(f"tool output: no conversation.item.added for the {kind} item")
    tool_reply = c.wire.responses_done()[1]
    if tool_reply["status"] != "completed":
        problems.append(f"tool output: the reply ended {tool_reply['status']}")


@pytest.mark.timeout(150)
async def test_openai_agents_sdk_realtime_session(duplex_server, kit):
    problems = await kit.run_sessions(duplex_server, lambda **kw: Client(kit, duplex_server, **kw), [
        ("voice", kit.voice_turns),
        ("text+tool", text_and_tool),
        ("text-only", kit.text_reply_to_speech),
    ])
    assert not problems, kit.report(problems)


async def hosted_mcp(c: Client, problems: list[str], url: str) -> None:
    """A HostedMCPTool as the SDK builds it, its tool_config sent unchanged in a session.update
    (the SDK validates it on the way out, and every event the server sends back on the way in)
    with a tool choice naming its tool: the server lists the MCP server and runs the call."""
    tool = HostedMCPTool(tool_config={
        "type": "mcp", "server_label": "calc", "server_url": url,
        "headers": {"Authorization": "Bearer agents-s3cret"}, "allowed_tools": ["add"],
        "require_approval": "never"})
    await c.session.model.send_event(RealtimeModelSendRawMessage(message={
        "type": "session.update", "other_data": {"session": {
            "type": "realtime", "tools": [tool.tool_config],
            "tool_choice": {"type": "mcp", "server_label": "calc", "name": "add"}}}}))
    await c.kit.wait_until(lambda: c.wire.count("mcp_list_tools.completed") >= 1, 20,
                           "mcp_list_tools.completed", c.wire)
    # The echo model says back a call it is told; tiny-omni is made to write one.
    call = {"name": "add", "arguments": {"a": 2, "b": 3}}
    await c.session.send_message(f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
                                 if c.model_kind == "echo" else "What is two and three?")
    await c.done(2, 60)
    calls = [i for r in c.wire.responses_done() for i in r["output"] if i["type"] == "mcp_call"]
    if not calls:
        problems.append("hosted MCP: no mcp_call in the replies")
    elif calls[0]["error"] or calls[0]["output"] != str(sum(json.loads(
            calls[0]["arguments"]).values())):
        problems.append(f"hosted MCP: the call came back {calls[0]}")


@pytest.mark.timeout(150)
async def test_openai_agents_sdk_hosted_mcp_tool(duplex_server, kit, mcp_servers):
    problems = await kit.run_sessions(
        duplex_server, lambda **kw: Client(kit, duplex_server, **kw),
        [("hosted MCP", functools.partial(hosted_mcp, url=mcp_servers.http_url))])
    assert not problems, kit.report(problems)
