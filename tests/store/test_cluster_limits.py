"""Session limits across two `duplex serve` nodes on one real redis-server, configured through
the environment alone: a node at the cluster's limit refuses as a lone node does, a closed
session frees its place at once, a killed node's places free when their lease ends."""

import json
import os
import signal

import httpx
import pytest
import redis
import websockets
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import eventually

pytestmark = pytest.mark.slow
LEASE_S = 1.5


@pytest.fixture
def two_nodes(server_process, redis_server):
    env = {**os.environ, "DUPLEX_REDIS_URL": redis_server.url, "DUPLEX_STORE__HEARTBEAT_S": "0.2",
           "DUPLEX_LIMITS__LEASE_S": str(LEASE_S), "DUPLEX_LIMITS__SESSIONS": "3",
           "DUPLEX_LIMITS__SESSIONS_PER_KEY": "2", "DUPLEX_AUTH__API_KEYS": "sk-1,sk-2"}
    return [server_process("--model", "echo", "--node-id", name, env=env) for name in "ab"]


async def open_session(node, key):
    ws = await websockets.connect(node.url.replace("http", "ws") + "/v1/realtime",
                                  additional_headers={"Authorization": f"Bearer {key}"})
    assert json.loads(await ws.recv())["type"] == "session.created"
    return ws


async def refusal(node, key):
    """The HTTP answer to a session refused at the handshake."""
    with pytest.raises(websockets.InvalidStatus) as info:
        ws = await open_session(node, key)
        await ws.close()
    response = info.value.response
    return response.status_code, response.headers["Retry-After"], json.loads(response.body)


def too_many(limit):
    return (429, "1", {"error": {"type": "requests", "code": "rate_limit_exceeded",
                                 "message": f"Too many concurrent sessions (limit {limit}).",
                                 "param": None}})


def samples(node, name):
    """Each sample of metric `name` on `node`'s /metrics, by its labels."""
    text = httpx.get(f"{node.url}/metrics").text
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def refused(node):
    """Sessions `node` refused at the limits, by reason."""
    return {dict(labels)["reason"]: value
            for labels, value in samples(node, "duplex_sessions_refused_total").items()}


async def admitted(node, key, opened):
    try:
        opened.append(await open_session(node, key))
    except websockets.InvalidStatus as refused:
        assert refused.response.status_code == 429
        return False
    return True


async def test_limits_hold_across_nodes_and_a_dead_nodes_sessions_stop_counting(two_nodes,
                                                                             redis_server):
    a, b = two_nodes
    on_a = [await open_session(a, "sk-1"), await open_session(a, "sk-1")]
    # Node B holds no session of sk-1, yet refuses a third as node A does.
    assert await refusal(b, "sk-1") == too_many("limits.sessions_per_key")
    assert await refusal(a, "sk-1") == too_many("limits.sessions_per_key")
    on_b = [await open_session(b, "sk-2")]
    assert await refusal(b, "sk-2") == too_many("limits.sessions")
    assert await refusal(a, "sk-2") == too_many("limits.sessions")
    for node in (a, b):
        assert refused(node) == {"sessions": 1, "sessions_per_key": 1}

    # Node A renews its places: they still count once its first leases have ended.
    sync = redis.Redis.from_url(redis_server.url)
    first_end = max(score for _, score in sync.zrange("duplex:seats", 0, -1, withscores=True))

    def redis_ms():
        seconds, micros = sync.time()
        return seconds * 1000 + micros // 1000

    await eventually(lambda: redis_ms() > first_end + 200, "node A's first leases ended")
    assert await refusal(b, "sk-2") == too_many("limits.sessions")

    # A session that closes gives its place back at once.
    await on_a.pop().close()
    await eventually(lambda: admitted(b, "sk-1", on_b), "node B takes the freed place")
    assert await refusal(b, "sk-2") == too_many("limits.sessions")

    # Killed, node A renews nothing: its last session stops counting when its lease ends.
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    assert await refusal(b, "sk-2") == too_many("limits.sessions")
    await eventually(lambda: admitted(b, "sk-1", on_b), "node B admits past A's lease",
                     timeout_s=LEASE_S + 10)
    assert await refusal(b, "sk-2") == too_many("limits.sessions")

    # Node B's sessions close and give their places back: none is left counted.
    for ws in on_b:
        await ws.close()
    await eventually(lambda: sync.zcard("duplex:seats") == 0, "every place given back")


async def refusal_at(node, query):
    with pytest.raises(websockets.InvalidStatus) as info:
        ws = await websockets.connect(node.url.replace("http", "ws") + "/v1/realtime" + query,
                                      additional_headers={"Authorization": "Bearer sk-1"})
        await ws.close()
    response = info.value.response
    return response.status_code, response.headers["Retry-After"], json.loads(response.body)


@pytest.fixture
def one_place(server_process, redis_server):
    """Two nodes whose cluster admits `sessions` at once."""
    def start(sessions):
        env = {**os.environ, "DUPLEX_REDIS_URL": redis_server.url,
               "DUPLEX_STORE__HEARTBEAT_S": "0.2", "DUPLEX_LIMITS__LEASE_S": "30",
               "DUPLEX_LIMITS__SESSIONS": str(sessions), "DUPLEX_AUTH__API_KEYS": "sk-1"}
        return [server_process("--model", "echo", "--node-id", name, env=env) for name in "ab"]

    return start


async def resumed_on(node, session, query=""):
    ws = await websockets.connect(node.url.replace("http", "ws") + "/v1/realtime" + query,
                                  additional_headers={"Authorization": "Bearer sk-1"})
    assert json.loads(await ws.recv())["type"] == "session.created"
    await ws.send(json.dumps({"type": "session.resume", "session_id": session["id"],
                              "resume_token": session["resume_token"]}))
    assert json.loads(await ws.recv())["type"] == "session.resumed"
    return ws


async def killed_with_a_session(a):
    """A session on node A, then node A killed: its place lives on until its lease ends (30 s
    here, past the test)."""
    ws = await websockets.connect(a.url.replace("http", "ws") + "/v1/realtime",
                                  additional_headers={"Authorization": "Bearer sk-1"})
    session = json.loads(await ws.recv())["session"]
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    return session


async def test_a_session_resumed_at_the_limit_on_another_node_keeps_its_one_place(one_place):
    a, b = one_place(sessions=1)
    session = await killed_with_a_session(a)
    assert await refusal(b, "sk-1") == too_many("limits.sessions")
    # Named and proved at the handshake, the resume takes the session's place over.
    query = f"?resume_session_id={session['id']}&resume_token={session['resume_token']}"
    ws = await resumed_on(b, session, query)
    assert await refusal(b, "sk-1") == too_many("limits.sessions")
    # A wrong token proves nothing: a new session, refused.
    assert await refusal_at(b, f"?resume_session_id={session['id']}&resume_token=rt_x") == \
        too_many("limits.sessions")
    await ws.close()
    opened = []
    await eventually(lambda: admitted(b, "sk-1", opened), "the resumed session's place freed")
    for ws in opened:
        await ws.close()


async def test_a_session_resumed_on_another_node_counts_once_from_its_resume(one_place):
    a, b = one_place(sessions=2)
    session = await killed_with_a_session(a)
    # Resumed the plain way (session.resume first): admitted as a second session, then
    # moved onto the session's place, so one more session fits, and no more.
    ws = await resumed_on(b, session)
    opened = []
    assert await admitted(b, "sk-1", opened)
    assert await refusal(b, "sk-1") == too_many("limits.sessions")
    for each in [ws, *opened]:
        await each.close()



async def test_a_node_that_loses_redis_counts_alone_and_says_so(server_process, redis_server):
    env = {**os.environ, "DUPLEX_REDIS_URL": redis_server.url, "DUPLEX_LIMITS__SESSIONS": "1",
           "DUPLEX_AUTH__API_KEYS": "sk-1"}
    node = server_process("--model", "echo", env=env)
    assert samples(node, "duplex_seats_local_fallback_total") == {(): 0}
    redis_server.stop()
    ws = await open_session(node, "sk-1")
    assert samples(node, "duplex_seats_local_fallback_total") == {(): 1}
    assert await refusal(node, "sk-1") == too_many("limits.sessions")
    assert refused(node) == {"sessions": 1, "sessions_per_key": 0}
    await ws.close()
