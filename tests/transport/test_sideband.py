"""A server's sideband on a browser's WebRTC call (`/v1/realtime?call_id=`), and ephemeral keys
that open calls with their settings: an aiortc caller, the official `openai` SDK as the server's
side, `duplex serve --model echo` with API keys."""

import asyncio
import json

import httpx
import pytest
import websockets
from openai import AsyncOpenAI

from duplex.transport import sideband as sidebands
from tests.conftest import ServerProcess
from tests.transport.test_webrtc import Caller
from tests.waiting import eventually

KEY, OTHER = "sk-sideband", "sk-someone-else"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
ASKS_WEATHER = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                "</tool_call>")



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("sideband") / "keys.toml"
    cfg.write_text(f'[auth]\napi_keys = ["{KEY}", "{OTHER}"]\n')
    server = ServerProcess(["--model", "echo", "--config", str(cfg)])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def sdk(server, key: str = KEY) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=key, base_url=f"{server.url}/v1",
                       websocket_base_url=server.url.replace("http", "ws") + "/v1")


async def next_of(connection, type_: str):
    async for event in connection:
        if event.type == type_:
            return event
    raise AssertionError(f"the sideband closed before {type_}")


async def drain(connection) -> list[str]:
    """The types of the events left until the connection closes normally."""
    return [event.type async for event in connection]


@pytest.mark.slow
async def test_a_sideband_runs_the_calls_tools_and_closes_with_it(server, wait_released,
                                                                  mcp_servers):
    caller = Caller()
    try:
        answer = await caller.connect(server.url, KEY)
        call_path = answer.headers["location"]
        call_id = call_path.rsplit("/", 1)[1]
        created = await caller.wait_for("session.created")

        async with sdk(server).realtime.connect(call_id=call_id) as sideband:
            # The sideband joins the call's session as it stands.
            joined = await next_of(sideband, "session.created")
            assert joined.session.id == created["session"]["id"]

            # The tools live on the server's side, an MCP server's secret included: the
            # browser sees them applied, and never the secret.
            mcp_servers.authorizations.clear()
            crm = {"type": "mcp", "server_label": "crm", "server_url": mcp_servers.http_url,
                   "authorization": "sideband-secret", "require_approval": "never"}
            await sideband.session.update(session={
                "type": "realtime", "instructions": "Answer about the weather.",
                "tools": [WEATHER, crm]})
            updated = await next_of(sideband, "session.updated")
            assert [t.type for t in updated.session.tools] == ["function", "mcp"]
            on_call = await caller.wait_for("session.updated")
            assert on_call["session"]["tools"][0]["name"] == "get_weather"
            assert (await caller.wait_for("mcp_list_tools.completed"))
            assert set(mcp_servers.authorizations) == {"Bearer sideband-secret"}

            # The browser asks; the model's call reaches the sideband, which answers it.
            caller.send({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": ASKS_WEATHER}]}})
            caller.send({"type": "response.create"})
            call = await next_of(sideband, "response.function_call_arguments.done")
            assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
            first = await next_of(sideband, "response.done")
            assert first.response.output[1].call_id == call.call_id
            await sideband.conversation.item.create(item={
                "type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny in Oslo"})
            await sideband.response.create()

            # One session: the reply the sideband asked for plays to the browser, and both
            # channels see it done with the tool's answer as its transcript.
            done = await caller.wait_for("response.done", count=2)
            assert done["response"]["status"] == "completed"
            spoken = done["response"]["output"][0]["content"][0]["transcript"]
            assert spoken == "Sunny in Oslo"
            assert await caller.wait_for("output_audio_buffer.started", count=2)
            second = await next_of(sideband, "response.done")
            assert second.response.id == done["response"]["id"]

            # Hanging up ends the call, and with it the sideband (a normal close); another
            # key's hang-up finds no call.
            async with httpx.AsyncClient() as client:
                url = f"{server.url}{call_path}/hangup"
                foreign = await client.post(url, headers={"Authorization": f"Bearer {OTHER}"})
                assert foreign.status_code == 404
                hung = await client.post(url, headers={"Authorization": f"Bearer {KEY}"})
                assert hung.status_code == 200
            rest = await asyncio.wait_for(drain(sideband), 10)
            assert "error" not in rest
        assert "sideband-secret" not in json.dumps([e for _, e in caller.events])
    finally:
        await caller.close()
    await wait_released(server)


async def refused(server, call_id: str, key: str) -> websockets.InvalidStatus:
    url = server.url.replace("http", "ws") + f"/v1/realtime?call_id={call_id}"
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}):
            pass
    return info.value


@pytest.mark.slow
async def test_an_unknown_or_anothers_call_is_not_found(server, wait_released):
    unknown = await refused(server, "rtc_nosuchcall", KEY)
    assert unknown.response.status_code == 404
    error = json.loads(unknown.response.body)["error"]
    assert error["code"] == "call_id_not_found" and "rtc_nosuchcall" in error["message"]

    caller = Caller()
    try:
        answer = await caller.connect(server.url, KEY)
        call_id = answer.headers["location"].rsplit("/", 1)[1]
        await caller.wait_for("session.created")
        # Another key's call does not exist for it.
        other = await refused(server, call_id, OTHER)
        assert other.response.status_code == 404
        assert json.loads(other.response.body)["error"]["code"] == "call_id_not_found"
        assert (await refused(server, call_id, "sk-wrong")).response.status_code == 401
    finally:
        await caller.close()
    await wait_released(server)


@pytest.mark.slow
async def test_an_ephemeral_key_opens_a_call_with_its_settings(server, wait_released):
    minted = await sdk(server).realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 60},
        session={"type": "realtime", "instructions": "You are a ship's cook.",
                 "audio": {"output": {"voice": "marin", "speed": 1.25}}, "tools": [WEATHER]})
    caller = Caller()
    try:
        await caller.connect(server.url, minted.value)
        session = (await caller.wait_for("session.created"))["session"]
        assert session["id"] == minted.session.id
        assert session["instructions"] == "You are a ship's cook."
        assert session["audio"]["output"]["voice"] == "marin"
        assert session["audio"]["output"]["speed"] == 1.25
        assert [t["name"] for t in session["tools"]] == ["get_weather"]
        # The minted key's tool is the call's: the model's call of it reaches the browser.
        caller.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": ASKS_WEATHER}]}})
        caller.send({"type": "response.create"})
        call = await caller.wait_for("response.function_call_arguments.done")
        assert call["name"] == "get_weather"
    finally:
        await caller.close()
    await wait_released(server)


class Socket:
    """What a sideband writes to: its events, in order."""

    def __init__(self):
        self.sent: list[str] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(text)


async def test_a_sideband_that_does_not_read_is_let_go_and_the_call_goes_on(monkeypatch):
    monkeypatch.setattr(sidebands, "MAX_QUEUED", 3)
    attached = sidebands.Sidebands()
    slow, quick = sidebands.Sideband(Socket()), sidebands.Sideband(Socket())
    assert attached.attach(slow, "created") and attached.attach(quick, "created")
    quick_writer = asyncio.create_task(quick.write())
    for i in range(4):
        attached.publish(f"e{i}")
        await eventually(lambda n=i + 2: len(quick.ws.sent) == n, "the quick sideband keeps up")
    # The slow one is closed as too slow, its backlog dropped; the other is still attached.
    assert len(attached) == 1 and (slow.close_code, slow.close_reason[:19]) == (
        1008, "sideband too slow: ")
    await slow.write()
    assert slow.ws.sent == []
    # The call ends: what was queued is written, then the close.
    attached.publish("last")
    attached.close()
    await quick_writer
    assert quick.ws.sent == ["created", "e0", "e1", "e2", "e3", "last"]
    assert quick.close_code == 1000
    assert not attached.attach(sidebands.Sideband(Socket()), None)
