"""The model's context is the conversation, over the wire with the official openai SDK against
`duplex serve` with the tiny Qwen3-Omni (greedy, text-only replies): edits anywhere in the
conversation (deletions, inserts at the root or after any item) reply exactly as the edited
conversation laid in one go on a fresh session; system and assistant items reach the model;
and the wire details clients rely on when they keep the conversation equal to their own."""

import json

import pytest

from tests.transport.sdk import client_for, events_until

pytestmark = pytest.mark.slow

A = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}
X = {"type": "message", "role": "system",
     "content": [{"type": "input_text", "text": "You are a pirate. Answer in riddles."}]}
B = {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "what is the weather like today"}]}
SAID = {"type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "Sure, one moment please."}]}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "21 C and sunny"}


class Session:
    def __init__(self, conn) -> None:
        self.conn = conn
        self.last_output: list[str] = []

    async def create(self, item: dict, item_id: str, previous: str | None = None):
        """Create the item under `item_id`; its conversation.item.added event."""
        kwargs = {} if previous is None else {"previous_item_id": previous}
        await self.conn.conversation.item.create(item={**item, "id": item_id}, **kwargs)
        events = await events_until(self.conn, "conversation.item.added", 30)
        assert "error" not in [e.type for e in events], events
        return events[-1]

    async def delete(self, item_id: str) -> None:
        await self.conn.conversation.item.delete(item_id=item_id)
        events = await events_until(self.conn, "conversation.item.deleted", 30)
        assert events[-1].item_id == item_id

    async def reply(self) -> str:
        await self.conn.response.create()
        events = await events_until(self.conn, "response.done", 120)
        assert "error" not in [e.type for e in events], [e for e in events if e.type == "error"]
        done = events[-1].response
        assert done.status == "completed", done.status_details
        self.last_output = [item.id for item in done.output]
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")

    async def error(self, send) -> object:
        await send
        return (await events_until(self.conn, "error", 30))[-1].error


async def opened(client):
    conn = await client.realtime.connect(model="tiny-omni").enter()
    assert (await conn.recv()).type == "session.created"
    await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                       "audio": {"input": {"turn_detection": None}}})
    await events_until(conn, "session.updated")
    return Session(conn)


async def fresh_reply(client, items: list[dict]) -> str:
    """The reply of a fresh session that creates `items` in order."""
    s = await opened(client)
    for n, item in enumerate(items):
        await s.create(item, f"fresh_{n}")
    text = await s.reply()
    await s.conn.close()
    return text


async def test_edits_reply_exactly_as_the_edited_conversation_laid_in_one_go(server_process,
                                                                            tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))
    client = client_for(server)
    plain = await fresh_reply(client, [A, B])

    # [A, X, B], then X deleted: the reply is [A, B]'s; with X it is not (a system item
    # reaches the model), nor with an assistant item in its place.
    s = await opened(client)
    await s.create(A, "a")
    await s.create(X, "x", "a")
    await s.create(B, "b")
    await s.delete("x")
    assert await s.reply() == plain
    await s.conn.close()
    assert await fresh_reply(client, [A, X, B]) != plain
    assert await fresh_reply(client, [A, SAID, B]) != plain

    # B first, then A inserted at the root: the reply is A-then-B's.
    s = await opened(client)
    added = await s.create(B, "b")
    assert (added.item.id, added.previous_item_id) == ("b", None)
    added = await s.create(A, "a", "root")
    assert (added.item.id, added.previous_item_id) == ("a", None)
    assert await s.reply() == plain
    await s.conn.close()

    # Built item by item, out of order, a reply in the middle deleted again, a function call
    # and its output, a message replaced under its own id: the same conversation created in
    # one go on a fresh session replies the same.
    s = await opened(client)
    await s.create(B, "b")
    await s.create(CALL, "call", "b")
    await s.reply()
    await s.create(OUTPUT, "out", "call")
    await s.create(A, "a", "root")
    await s.create(SAID, "said", "a")
    await s.delete("said")
    await s.create(SAID, "said", "a")
    for item_id in s.last_output:
        await s.delete(item_id)
    built = await s.reply()
    await s.conn.close()
    assert built == await fresh_reply(client, [A, SAID, B, CALL, OUTPUT])


async def test_the_wire_details_clients_rely_on(server_process, tiny_omni_dir):
    server = server_process("--model", str(tiny_omni_dir))
    client = client_for(server)
    s = await opened(client)
    await s.create(A, "a")
    error = await s.error(s.conn.conversation.item.create(item={**B, "id": "a"}))
    assert error.code == "item_create_duplicate_item_id" and error.param == "item.id"
    error = await s.error(s.conn.conversation.item.create(
        item={**OUTPUT, "call_id": "call_nobody"}))
    assert error.code == "invalid_tool_call_id"
    assert "call_nobody" in error.message
    # A client's own function call counts as a call; a deleted id may be created again.
    await s.create(CALL, "call")
    await s.create(OUTPUT, "out")
    await s.delete("a")
    added = await s.create(A, "a", "call")
    assert (added.item.id, added.previous_item_id) == ("a", "call")
    assert [p.type for p in added.item.content] == ["input_text"]
    await s.reply()
    await s.conn.close()
    assert json.loads(CALL["arguments"]) == {"city": "Paris"}
