"""MCP tools the server runs, through the official openai SDK against `duplex serve`, with a
real MCP server (the SDK's own class) on loopback: listings over streamable HTTP and SSE, a
forced call on the echo model and on tiny-omni, the result spoken by the next reply, an
approval, a tool error, a timeout and a server that is not there, each a `failed` event with
the session going on; and the MCP server's authorization header seen by it alone."""

import asyncio
import json
import os

import jsonschema
import pytest

from tests.transport.sdk import client_for

pytestmark = pytest.mark.slow

SECRET = "Bearer mcp-s3cret"


async def until(conn, done, timeout: float = 60.0) -> list:
    """The events the connection yields until `done(events)` holds."""
    events = []

    async def run():
        async for event in conn:
            events.append(event)
            if done(events):
                return

    await asyncio.wait_for(run(), timeout)
    return events


def count(kind: str, n: int):
    return lambda events: sum(e.type == kind for e in events) >= n


def of(events, kind: str) -> list:
    return [e for e in events if e.type == kind]


def errors(events) -> list:
    return [e.error.message for e in of(events, "error")]


def calc(url: str, **over) -> dict:
    return {"type": "mcp", "server_label": "calc", "server_url": url,
            "headers": {"Authorization": SECRET}, "require_approval": "never", **over}


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def say(conn, text: str, **response) -> None:
    await conn.conversation.item.create(item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    await conn.response.create(response=response)


def reply_text(done) -> str:
    return "".join(part.text or "" for item in done.response.output if item.type == "message"
                   for part in item.content)


async def test_mcp_tools_on_the_echo_model(server_process, mcp_servers):
    """The echo model says back what it is told: a call when the text it echoes is one, then
    the tool's output, which the server gave it as the tool's response."""
    server = server_process("--model", "echo",
                            env={**os.environ, "DUPLEX_REALTIME__MCP_TIMEOUT_S": "2"})
    mcp_servers.authorizations.clear()
    async with client_for(server).realtime.connect(model="echo") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
            "tools": [calc(mcp_servers.http_url, allowed_tools=["add", "fail", "stall"]),
                      {"type": "mcp", "server_label": "words",
                       "server_url": mcp_servers.sse_url, "require_approval": "always"},
                      {"type": "mcp", "server_label": "gone",
                       "server_url": "http://127.0.0.1:1/mcp"}]})
        # Each listing ends with its item done: its tools, or none when it failed.
        events = await until(conn, count("conversation.item.done", 3))
        [updated] = of(events, "session.updated")
        assert [t.headers for t in updated.session.tools] == [None, None, None]
        lists = {e.item.server_label: e.item for e in of(events, "conversation.item.done")}
        assert [t.name for t in lists["calc"].tools] == ["add", "fail", "stall"]
        assert [t.name for t in lists["words"].tools] == ["add", "shout", "fail", "stall"]
        assert len(of(events, "mcp_list_tools.completed")) == 2
        [gone] = of(events, "mcp_list_tools.failed")
        assert (gone.item_id, lists["gone"].tools) == (lists["gone"].id, [])
        assert gone.model_dump()["error"]["code"] == 502

        # A forced call: the reply is the call, the server runs it, the next reply speaks.
        await say(conn, call_text("add", {"a": 2, "b": 3}),
                  tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
        events = await until(conn, count("response.done", 2))
        assert not errors(events)
        types = [e.type for e in events]
        assert types.index("response.mcp_call_arguments.done") \
            < types.index("response.mcp_call.in_progress") \
            < types.index("response.mcp_call.completed") < types.index("response.done")
        first, second = of(events, "response.done")
        [item] = [i for i in first.response.output if i.type == "mcp_call"]
        assert (item.server_label, item.name, item.output) == ("calc", "add", "5")
        assert json.loads(item.arguments) == {"a": 2, "b": 3}
        assert reply_text(second) == "5"
        assert mcp_servers.authorizations and set(mcp_servers.authorizations) == {SECRET}

        # A tool that fails and one that does not answer in time: failed, and the session
        # goes on (the model is told, and says so).
        for name, kind in (("fail", "tool_execution_error"), ("stall", "http_error")):
            await say(conn, call_text(name, {}))
            events = await until(conn, count("response.done", 2))
            [failed] = of(events, "response.mcp_call.failed")
            [item] = [i for i in of(events, "response.done")[0].response.output
                      if i.type == "mcp_call"]
            assert item.id == failed.item_id and item.error.type == kind
            assert reply_text(of(events, "response.done")[1]).startswith("The call failed")

        # A call that waits for the client's approval (over SSE).
        await say(conn, call_text("shout", {"text": "hi there"}))
        events = await until(conn, count("response.done", 1))
        [request] = [i for i in events[-1].response.output if i.type == "mcp_approval_request"]
        assert (request.server_label, request.name) == ("words", "shout")
        await conn.conversation.item.create(item={
            "type": "mcp_approval_response", "approval_request_id": request.id,
            "approve": True})
        events = await until(conn, count("response.done", 1))
        [call] = [e.item for e in of(events, "conversation.item.done")
                  if e.item.type == "mcp_call"]
        assert (call.approval_request_id, call.output) == (request.id, "HI THERE")
        assert reply_text(events[-1]) == "HI THERE"
    assert SECRET not in server.output() and "s3cret" not in server.output()


async def test_a_forced_mcp_call_on_tiny_omni_has_arguments_that_follow_the_schema(
        server_process, tiny_omni_dir, mcp_servers):
    """The random model is held to the tool's schema: its call is run, and answered."""
    server = server_process("--model", str(tiny_omni_dir))
    async with client_for(server).realtime.connect(model="tiny") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
            "tools": [calc(mcp_servers.http_url)],
            "tool_choice": {"type": "mcp", "server_label": "calc", "name": "add"}})
        events = await until(conn, count("conversation.item.done", 1))
        [listing] = [e.item for e in of(events, "conversation.item.done")]
        await say(conn, "what is two and three?")
        events = await until(conn, count("response.done", 2), timeout=120)
        assert not errors(events)
        first, second = of(events, "response.done")
        [item] = [i for i in first.response.output if i.type == "mcp_call"]
        arguments = json.loads(item.arguments)
        jsonschema.validate(arguments, listing.tools[0].input_schema)
        assert item.output == str(arguments["a"] + arguments["b"])
        assert second.response.status == "completed"


async def after_a_call(client, url: str, edit: str | None) -> str:
    """A tiny-omni session where the user asks, the model calls `add` (forced) and speaks with
    its output; then `edit`: "insert" (an item at the root, laid, then deleted: the context is
    rewound to its start and laid again twice) or "delete" (the mcp_call item); then the text
    of one more reply."""
    async with client.realtime.connect(model="tiny") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"turn_detection": None}},
            # One tool: the random model's replies then follow what the context holds.
            "tools": [calc(url, allowed_tools=["add"])]})
        await until(conn, count("conversation.item.done", 1))
        await say(conn, "hello there",
                  tool_choice={"type": "mcp", "server_label": "calc", "name": "add"})
        events = await until(conn, count("response.done", 2), timeout=120)
        assert not errors(events)
        [item] = [i for i in of(events, "response.done")[0].response.output
                  if i.type == "mcp_call"]
        assert item.output is not None
        if edit == "insert":
            await conn.conversation.item.create(previous_item_id="root", item={
                "type": "message", "role": "system", "id": "x",
                "content": [{"type": "input_text", "text": "You are a pirate."}]})
            await until(conn, count("conversation.item.added", 1))
            await conn.conversation.item.delete(item_id="x")
            await until(conn, count("conversation.item.deleted", 1))
        elif edit == "delete":
            await conn.conversation.item.delete(item_id=item.id)
            await until(conn, count("conversation.item.deleted", 1))
        await conn.response.create()
        events = await until(conn, count("response.done", 1), timeout=120)
        assert not errors(events) and events[-1].response.status == "completed"
        return reply_text(events[-1])


async def test_an_mcp_calls_output_is_in_the_context_as_the_conversation_has_it(
        server_process, tiny_omni_dir, mcp_servers):
    """Greedy: a conversation rewound to its start and laid again (an item inserted at the
    root, then deleted) replies exactly as the same conversation never edited, the call's
    output laid again in its place; with the mcp_call item deleted, its output is gone."""
    server = server_process("--model", str(tiny_omni_dir))
    client = client_for(server)
    plain = await after_a_call(client, mcp_servers.http_url, None)
    assert await after_a_call(client, mcp_servers.http_url, "insert") == plain
    assert await after_a_call(client, mcp_servers.http_url, "delete") != plain
