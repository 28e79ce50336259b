"""Resume in the pure protocol core, and through the openai SDK on the in-memory registry."""

import base64
import json

import httpx
import numpy as np
import pytest

from duplex.transport.effects import CloseConnection, Send
from duplex.transport.realtime.protocol import RealtimeProtocol, ResumeSession
from tests.transport.sdk import client_for
from tests.waiting import eventually

RATE = 24000


def make(token="rt_secret"):
    p = RealtimeProtocol("sess_new", model="echo", model_input_rate=RATE,
                         model_output_rate=RATE, resume_token=token)
    return p


def sent(effects):
    return [e.event for e in effects if isinstance(e, Send)]


def send(p, **event):
    return p.receive_text(json.dumps(event))


def test_created_carries_id_and_token_and_resume_must_come_first():
    p = make()
    [created] = sent(p.start())
    assert created["session"]["id"] == "sess_new"
    assert created["session"]["resume_token"] == "rt_secret"
    assert send(p, type="session.resume", session_id="sess_old",
                resume_token="rt_x") == [ResumeSession("sess_old", "rt_x")]
    p2 = make()
    p2.start()
    send(p2, type="input_audio_buffer.clear")
    [error] = sent(send(p2, type="session.resume", session_id="s", resume_token="t"))
    assert error["error"]["code"] == "session_resume_not_first"
    [error] = sent(make().refuse("session_expired", "gone", "session_id"))
    assert (error["type"], error["error"]["code"]) == ("error", "session_expired")


def run_reply(p, seconds, played_s):
    """Produce a reply of `seconds` (echo-style text per 80 ms frame); play `played_s` of it."""
    send(p, type="session.update", session={"audio": {"input": {"turn_detection": None}}})
    audio = (np.zeros(RATE // 5)).astype("<i2").tobytes()
    send(p, type="input_audio_buffer.append", audio=base64.b64encode(audio).decode())
    send(p, type="input_audio_buffer.commit")
    send(p, type="response.create")
    epoch = p.response.epoch
    frame = 1920
    for i in range(int(seconds * RATE) // frame):
        p.on_engine_audio(epoch, np.zeros(frame, np.float32), f"frame{i} ")
    now = int(played_s * RATE)
    for t in range(0, now + 1, 480):
        p.release_output(t)
    return now


def test_snapshot_keeps_what_was_heard_and_resumed_restores_it():
    p = make()
    p.start()
    now = run_reply(p, 2.0, 0.5)
    items, config = p.snapshot(now)
    assert [i["role"] for i in items] == ["user", "assistant"]
    words = items[1]["transcript"].split()
    # 0.5 s heard of 80 ms frames: frames 0..6 started before the watermark.
    assert words == [f"frame{i}" for i in range(7)]
    assert items[1]["status"] == "in_progress"
    assert config["turn_detection"] is None

    q = make(token=None)
    q.start()
    [resumed] = sent(q.resumed("sess_old", items, config))
    assert resumed["type"] == "session.resumed" and resumed["session"]["id"] == "sess_old"
    assert resumed["session"]["audio"]["input"]["turn_detection"] is None
    [retrieved] = sent(send(q, type="conversation.item.retrieve", item_id=items[1]["id"]))
    assert retrieved["item"]["status"] == "incomplete"
    assert retrieved["item"]["content"][0]["transcript"] == items[1]["transcript"]


def test_end_says_why_and_closes():
    p = make()
    p.start()
    effects = p.end("session_taken_over", "resumed elsewhere", 4409, "session taken over")
    assert sent(effects)[0]["error"]["code"] == "session_taken_over"
    assert effects[-1] == CloseConnection(4409, "session taken over")
    assert p.receive_text('{"type": "response.create"}') == []


@pytest.mark.slow
async def test_sdk_client_resumes_on_the_same_node(server_process):
    server = server_process("--model", "echo")
    client = client_for(server)
    async with client.realtime.connect(model="echo") as conn:
        created = await conn.recv()
        session_id = created.session.id
        token = created.session.model_extra["resume_token"]
        await conn.session.update(session={"type": "realtime", "instructions": "remember me"})
        await conn.recv()
        await conn.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]})
        added = await conn.recv()
    # The registry keeps what the session held when its connection ended.
    await eventually(lambda: httpx.get(f"{server.url}/healthz").json()["active_sessions"] == 0,
                     "the first connection's session ends")
    async with client.realtime.connect(model="echo") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.send({"type": "session.resume", "session_id": session_id,
                         "resume_token": token})
        resumed = await conn.recv()
        assert resumed.type == "session.resumed"
        # An event type the SDK does not know arrives as a loose object with plain dicts.
        assert (resumed.session["id"], resumed.session["instructions"]) == (session_id, "remember me")
        await conn.conversation.item.retrieve(item_id=added.item.id)
        item = await conn.recv()
        assert item.item.content[0].text == "hi"
