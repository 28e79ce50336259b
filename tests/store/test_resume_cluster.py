"""Two `duplex serve --model echo` nodes sharing one real redis-server: resume across nodes,
fencing of a stale owner, and a Redis restart under a live session."""

import asyncio
import base64
import json
import os
import signal

import httpx
import numpy as np
import pytest
import redis
import websockets

from tests.waiting import eventually

RATE = 24000
FRAME_BYTES = 1920 * 2
pytestmark = pytest.mark.slow


def pcm16(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return (rng.uniform(-0.3, 0.3, int(RATE * seconds)) * 32767).astype("<i2").tobytes()


@pytest.fixture
def cluster(server_process, redis_server):
    env = {**os.environ, "DUPLEX_STORE__HEARTBEAT_S": "0.2", "DUPLEX_REDIS_URL": redis_server.url}

    def node(name):
        return server_process("--model", "echo", "--node-id", name, env=env)

    return node


class Client:
    def __init__(self, ws):
        self.ws = ws

    @classmethod
    async def connect(cls, server):
        ws = await websockets.connect(server.url.replace("http", "ws") + "/v1/realtime",
                                      compression=None, max_size=None)
        return cls(ws)

    async def send(self, type_, **fields):
        await self.ws.send(json.dumps({"type": type_, **fields}))

    async def recv(self, timeout=10.0):
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, type_, timeout=15.0):
        events = []
        while True:
            events.append(await self.recv(timeout))
            if events[-1]["type"] == type_:
                return events

    async def manual_turn(self, audio: bytes):
        await self.send("input_audio_buffer.append", audio=base64.b64encode(audio).decode())
        await self.send("input_audio_buffer.commit")
        await self.send("response.create")


async def new_session(server, instructions="be brief", client=Client):
    """A session with `instructions` and no turn detection, on a `client` of this kind."""
    c = await client.connect(server)
    created = await c.recv()
    assert created["type"] == "session.created"
    await c.send("session.update", session={"type": "realtime", "instructions": instructions,
                                           "audio": {"input": {"turn_detection": None}}})
    await c.until("session.updated")
    return c, created["session"]


async def resume(server, session, client=Client):
    c = await client.connect(server)
    assert (await c.recv())["type"] == "session.created"
    await c.send("session.resume", session_id=session["id"], resume_token=session["resume_token"])
    return c, await c.recv()


def registry_entry(redis_url, session_id):
    return redis.Redis.from_url(redis_url, decode_responses=True).hgetall(f"duplex:s:{session_id}")


async def heard_words_saved(redis_url, session_id, n):
    """Wait until the registry holds at least `n` heard words of the assistant's reply."""
    def saved():
        entry = registry_entry(redis_url, session_id)
        items = json.loads(entry.get("conversation", "[]"))
        heard = [i.get("transcript") or "" for i in items if i.get("role") == "assistant"]
        return heard and len(heard[-1].split()) >= n

    await eventually(saved, f"{n} heard words in the registry")


def active_sessions(server):
    return httpx.get(f"{server.url}/healthz").json()["active_sessions"]


async def test_session_resumes_on_another_node_after_its_node_is_killed(cluster, redis_server):
    a, b = cluster("a"), cluster("b")
    client, session = await new_session(a)
    assert session["id"].startswith("sess_") and session["resume_token"].startswith("rt_")
    entry = registry_entry(redis_server.url, session["id"])
    assert entry["owner"] == "a" and entry["epoch"] == "1"
    assert session["resume_token"] not in json.dumps(entry)

    # 3 s of reply paced at real time: kill node A about a second into it.
    await client.manual_turn(pcm16(3.0, seed=1))
    received = 0
    while received < RATE * 2:
        event = await client.recv()
        if event["type"] == "response.output_audio.delta":
            received += len(base64.b64decode(event["delta"]))
    await heard_words_saved(redis_server.url, session["id"], 5)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    frames_sent = -(-received // FRAME_BYTES)
    with pytest.raises(websockets.ConnectionClosedError):
        async for message in client.ws:
            event = json.loads(message)
            if event["type"] == "response.output_audio.delta":
                frames_sent += -(-len(base64.b64decode(event["delta"])) // FRAME_BYTES)

    client, resumed = await resume(b, session)
    assert resumed["type"] == "session.resumed"
    assert resumed["session"]["id"] == session["id"]
    assert resumed["session"]["instructions"] == "be brief"
    assert resumed["session"]["audio"]["input"]["turn_detection"] is None
    entry = registry_entry(redis_server.url, session["id"])
    assert entry["owner"] == "b" and entry["epoch"] == "2"
    stored = json.loads(entry["conversation"])
    assert [i["role"] for i in stored] == ["user", "assistant"]

    # Nothing is replayed, and the reply's transcript is what was heard: a prefix of it.
    with pytest.raises(TimeoutError):
        await client.recv(timeout=0.5)
    await client.send("conversation.item.retrieve", item_id=stored[1]["id"])
    item = (await client.recv())["item"]
    words = item["content"][0]["transcript"].split()
    assert item["status"] == "incomplete"
    assert 5 <= len(words) <= frames_sent < 38
    assert words == [f"frame{i}" for i in range(len(words))]

    # The conversation goes on on node B.
    await client.manual_turn(pcm16(0.4, seed=2))
    events = await client.until("response.done")
    assert events[-1]["response"]["status"] == "completed"
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert committed["previous_item_id"] == stored[1]["id"]
    await client.ws.close()


async def test_stale_owner_is_fenced_and_bad_resumes_are_refused(cluster, redis_server):
    a, b = cluster("a"), cluster("b")
    old, session = await new_session(a)

    client, answer = await resume(b, {**session, "resume_token": "rt_wrong"})
    assert answer["error"]["code"] == "resume_token_invalid"
    await client.ws.close()
    client, answer = await resume(b, {**session, "id": "sess_nope"})
    assert answer["error"]["code"] == "session_not_found"
    await client.ws.close()

    # B claims the session while A still serves it: A stops at its next heartbeat.
    new, answer = await resume(b, session)
    assert answer["type"] == "session.resumed"
    events = []
    with pytest.raises(websockets.ConnectionClosed) as info:
        while True:
            events.append(await old.recv(timeout=3))
    assert events[-1]["error"]["code"] == "session_taken_over"
    assert info.value.rcvd.code == 4409
    entry = registry_entry(redis_server.url, session["id"])
    assert (entry["owner"], entry["epoch"]) == ("b", "2")
    # A's final save on close was refused too: the record is still B's.
    await eventually(lambda: active_sessions(a) == 0, "node A's session ended")
    assert registry_entry(redis_server.url, session["id"])["owner"] == "b"
    await new.manual_turn(pcm16(0.3, seed=3))
    assert (await new.until("response.done"))[-1]["response"]["status"] == "completed"
    await new.ws.close()


async def test_redis_restart_leaves_sessions_live_and_the_registry_reconciles(cluster, redis_server):
    a, b = cluster("a"), cluster("b")
    client, session = await new_session(a)
    redis_server.stop()
    # The session goes on without its registry.
    await client.manual_turn(pcm16(0.3, seed=4))
    assert (await client.until("response.done"))[-1]["response"]["status"] == "completed"
    redis_server.start()
    assert registry_entry(redis_server.url, session["id"]) == {}
    entry = await eventually(lambda: registry_entry(redis_server.url, session["id"]),
                             "the owner writes its session again")
    assert entry["owner"] == "a"
    assert [i["role"] for i in json.loads(entry["conversation"])] == ["user", "assistant"]
    await client.ws.close()
    resumed_client, resumed = await resume(b, session)
    assert resumed["type"] == "session.resumed"
    await resumed_client.ws.close()
