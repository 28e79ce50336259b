"""The model's context survives a resume: two `duplex serve` nodes with the tiny Qwen3-Omni on
one real redis-server, node A killed, the session resumed on node B. With greedy sampling the
reply after the resume is, token for token, the reply an uninterrupted session gives to the
same conversation. A resume on the node that kept the dropped connection's engine state takes
it over with no prefill at all. (What was generated but never heard stays out of the record:
tests/store/test_context.py.)"""

import asyncio
import base64
import contextlib
import json
import os
import re
import signal

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from duplex.media import ulaw_encode
from duplex.store import StoredContext
from duplex.store.context import AudioSpan, ContextRecord
from tests.store.test_resume_cluster import Client as WireClient
from tests.store.test_resume_cluster import new_session as wire_session
from tests.store.test_resume_cluster import resume as wire_resume
from tests.waiting import eventually

RATE = 24000
pytestmark = pytest.mark.slow


def pcm16(seconds: float, seed: int) -> str:
    rng = np.random.default_rng(seed)
    audio = (rng.uniform(-0.3, 0.3, int(RATE * seconds)) * 32767).astype("<i2").tobytes()
    return base64.b64encode(audio).decode()


@pytest.fixture
def omni_cluster(server_process, redis_server, tiny_omni_dir):
    env = {**os.environ, "DUPLEX_STORE__HEARTBEAT_S": "0.2", "DUPLEX_REDIS_URL": redis_server.url}

    def node(name):
        return server_process("--model", str(tiny_omni_dir), "--node-id", name, env=env)

    return node


class Client(WireClient):
    """The cluster tests' wire client, waiting as long as tiny-omni's replies take; an error
    on the way fails the test."""

    async def recv(self, timeout=30.0):
        return await super().recv(timeout)

    async def until(self, type_, timeout=60.0):
        events = await super().until(type_, timeout)
        assert not [e for e in events if e["type"] == "error"], events
        return events

    async def reply(self, **response):
        """Ask for a reply; its transcript (audio) or text, as sent."""
        await self.send("response.create", response=response)
        events = await self.until("response.done")
        self.usage = events[-1]["response"]["usage"]
        assert events[-1]["response"]["status"] in ("completed", "incomplete")
        return "".join(e["delta"] for e in events if e["type"] in (
            "response.output_audio_transcript.delta", "response.output_text.delta"))

    async def audio_turn(self, seed):
        await self.send("input_audio_buffer.append", audio=pcm16(0.8, seed))
        await self.send("input_audio_buffer.commit")

    async def text_turn(self, text):
        await self.send("conversation.item.create", item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]})
        await self.until("conversation.item.done")


async def new_session(server):
    return await wire_session(server, "You are terse.", Client)


async def resume(server, session):
    return await wire_resume(server, session, Client)


def saved(redis_url, session_id):
    """The conversation and the model context the registry holds, as one save left them."""
    with redis.Redis.from_url(redis_url, decode_responses=True).pipeline() as pipe:
        entry, parts = pipe.hgetall(f"duplex:s:{session_id}").hgetall(
            f"duplex:c:{session_id}").execute()
    return (json.loads(entry.get("conversation", "[]")),
            StoredContext(json.loads(entry.get("context", "{}")), parts, tuple(parts)))


async def heard_in_full(redis_url, session_id, transcripts):
    """Wait until the registry holds every reply as heard in full (the playback estimate has
    caught up with the last audio sent)."""
    def done():
        items, _ = saved(redis_url, session_id)
        heard = [i.get("transcript") or i.get("text") or "" for i in items
                 if i.get("role") == "assistant"]
        return heard == transcripts

    await eventually(done, "every reply heard in full in the registry")


def heard_audio(redis_url, session_id):
    """Each user audio turn as the model heard it (16-bit, at its input rate), from the
    context record the session's node saved."""
    _, stored = saved(redis_url, session_id)
    rate = stored.index.get("input_rate", 0)
    context = ContextRecord.from_record(stored, rate, RATE, RATE, 1 << 30)
    return [s.pcm() for s in context.spans if isinstance(s, AudioSpan)]


GREEDY = {"max_output_tokens": 8}


async def conversation_before(client):
    """An audio turn answered in speech, a text turn answered in text."""
    await client.audio_turn(seed=11)
    first = await client.reply(**GREEDY)
    await client.text_turn("and what about tomorrow?")
    second = await client.reply(output_modalities=["text"], **GREEDY)
    return [first, second]


async def test_reply_after_resume_on_another_node_equals_the_uninterrupted_reply(
        omni_cluster, redis_server):
    a, b = omni_cluster("a"), omni_cluster("b")
    client, session = await new_session(a)
    await client.send("session.update", session={"type": "realtime", "temperature": 0})
    await client.until("session.updated")
    before = await conversation_before(client)
    assert before[1]
    await heard_in_full(redis_server.url, session["id"], before)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()

    client, resumed = await resume(b, session)
    assert resumed["type"] == "session.resumed"
    rebuilt = resumed["rebuilt_context"]
    # The audio turn, its reply, the text turn, its reply; the 0.8 s sent but the last
    # 1.3 ms, which the input resampler holds until the input its filter centres on is in.
    assert (rebuilt["items"], rebuilt["left_out_items"], rebuilt["kept_live"]) == (4, 0, False)
    assert 0.798 <= rebuilt["audio_seconds"] <= 0.8
    # An audio turn after the resume: the new connection's input resampler goes on from
    # where node A's stood, so the model hears the samples an uninterrupted session's would
    # (the few ms A's still held included).
    await client.audio_turn(seed=12)
    after = await client.reply(output_modalities=["text"], **GREEDY)
    await client.text_turn("and the day after?")
    after_text = await client.reply(output_modalities=["text"], **GREEDY)
    await client.ws.close()

    reference, reference_session = await new_session(b)
    await reference.send("session.update", session={"type": "realtime", "temperature": 0})
    await reference.until("session.updated")
    assert await conversation_before(reference) == before
    await reference.audio_turn(seed=12)
    expected = await reference.reply(output_modalities=["text"], **GREEDY)
    await reference.text_turn("and the day after?")
    expected_text = await reference.reply(output_modalities=["text"], **GREEDY)
    await reference.ws.close()
    assert after and after == expected
    assert after_text and after_text == expected_text
    # The tiny model's few greedy tokens might not notice a few ms; the samples it was given
    # show it: both audio turns reached it identically on both paths.
    resumed_audio = await eventually(
        lambda: len(a := heard_audio(redis_server.url, session["id"])) == 2 and a,
        "the resumed session's second audio turn saved")
    reference_audio = await eventually(
        lambda: len(a := heard_audio(redis_server.url, reference_session["id"])) == 2 and a,
        "the reference session's second audio turn saved")
    for got, want in zip(resumed_audio, reference_audio, strict=True):
        assert len(got) == len(want) and np.array_equal(got, want)

    # Without the context the same question gets another answer: the rebuild is what made
    # them equal.
    fresh, _ = await new_session(b)
    await fresh.send("session.update", session={"type": "realtime", "temperature": 0})
    await fresh.until("session.updated")
    await fresh.audio_turn(seed=12)
    assert await fresh.reply(output_modalities=["text"], **GREEDY) != expected
    await fresh.ws.close()


def pcmu_chunks(seconds: float, seed: int) -> list[str]:
    """Telephone noise as a Realtime client sends it: mu-law at 8 kHz, 20 ms an append."""
    rng = np.random.default_rng(seed)
    audio = ulaw_encode((rng.uniform(-0.3, 0.3, int(8000 * seconds)) * 32767).astype(np.int16))
    return [base64.b64encode(audio[i:i + 160]).decode() for i in range(0, len(audio), 160)]


async def g711_session(server):
    client, session = await new_session(server)
    await client.send("session.update", session={
        "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}}}})
    await client.until("session.updated")
    return client, session


async def g711_turn(client, seed):
    for chunk in pcmu_chunks(0.8, seed):
        await client.send("input_audio_buffer.append", audio=chunk)
    await client.send("input_audio_buffer.commit")
    await client.until("conversation.item.done")


async def g711_saved(redis_url, session_id, turns):
    """Wait until the session's record was saved with `turns` user items; then its audio is
    everything the model was given."""
    def user_items():
        return sum(i.get("role") == "user" for i in saved(redis_url, session_id)[0])

    await eventually(lambda: user_items() == turns, f"{turns} user turns in the saved record")
    return np.concatenate(heard_audio(redis_url, session_id))


@contextlib.asynccontextmanager
async def context_writes(redis_url, session_id):
    """The parts of the session's context written from now on, by name: the fenced save
    script's HSETs, as redis-server's MONITOR shows them. Complete once the block ends."""
    key, marker = f"duplex:c:{session_id}", f"written:{session_id}"
    written: dict[str, int] = {}
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    async with client.monitor() as monitor:
        async def listen():
            async for info in monitor.listen():
                words = info["command"].split(" ", 3)
                if info["client_type"] == "lua" and words[:2] == ["HSET", key]:
                    written[words[2]] = len(words[3])
                elif words == ["ECHO", marker]:
                    return

        task = asyncio.create_task(listen())
        yield written
        # MONITOR reports commands in the order they ran: once the marker shows, every
        # write before it has.
        async with aioredis.Redis.from_url(redis_url) as other:
            await other.echo(marker)
        await asyncio.wait_for(task, 10)
    await client.aclose()


@pytest.mark.parametrize("drop", ["node_killed", "connection_dropped"])
async def test_a_g711_session_s_model_input_goes_on_sample_for_sample_after_a_resume(
        drop, server_process, redis_server, tiny_omni_dir):
    """mu-law input goes 8 -> 24 kHz onto the session clock, then 24 -> 16 kHz to the model:
    both resamplers go on where the dropped connection's stood, from the saved record on
    another node or from the state kept live on the same one. The resumed session writes
    the registry only the audio that came after the resume, not the context it already
    holds."""
    env = {**os.environ, "DUPLEX_STORE__HEARTBEAT_S": "0.2", "DUPLEX_REDIS_URL": redis_server.url,
           "DUPLEX_STORE__KEEP_LIVE_S": "30"}
    nodes = [server_process("--model", str(tiny_omni_dir), "--node-id", name, env=env)
             for name in (["a", "b"] if drop == "node_killed" else ["a"])]
    client, session = await g711_session(nodes[0])
    await g711_turn(client, seed=21)
    await g711_saved(redis_server.url, session["id"], 1)
    if drop == "node_killed":
        nodes[0].proc.send_signal(signal.SIGKILL)
        nodes[0].proc.wait()
    else:
        await client.ws.close()
        await eventually(
            lambda: httpx.get(f"{nodes[0].url}/healthz").json()["active_sessions"] == 0,
            "the dropped connection's session ends")
    node = nodes[-1]
    held = saved(redis_server.url, session["id"])[1]

    async with context_writes(redis_server.url, session["id"]) as written:
        client, resumed = await resume(node, session)
        assert resumed["type"] == "session.resumed"
        assert resumed["session"]["audio"]["input"]["format"]["type"] == "audio/pcmu"
        assert resumed["rebuilt_context"]["kept_live"] is (drop == "connection_dropped")
        await g711_turn(client, seed=22)
        got = await g711_saved(redis_server.url, session["id"], 2)
    await client.ws.close()
    after = saved(redis_server.url, session["id"])[1]
    assert written and set(written) == set(after.names) - set(held.names)
    # The turn's 0.8 s of 16 kHz noise as base64 FLAC, in as many pieces as saves caught it
    # in: about what the turn before it took, and nothing of that one again.
    first_turn = sum(map(len, held.parts.values()))
    assert first_turn > 15_000 and sum(written.values()) < 1.5 * first_turn

    reference, reference_session = await g711_session(node)
    await g711_turn(reference, seed=21)
    await g711_turn(reference, seed=22)
    want = await g711_saved(redis_server.url, reference_session["id"], 2)
    await reference.ws.close()
    # 1.6 s at 16 kHz, less what the two filters still hold for their centres' input.
    assert 25400 < len(want) <= 25600
    assert len(got) == len(want) and np.array_equal(got, want)


def prefill_calls(server):
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(r'^duplex_stage_batch_size_count\{stage="prefill"\} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


async def test_a_resume_on_the_node_that_kept_the_live_state_takes_it_over_without_prefill(
        server_process, redis_server, tiny_omni_dir):
    env = {**os.environ, "DUPLEX_STORE__KEEP_LIVE_S": "30", "DUPLEX_REDIS_URL": redis_server.url}
    node = server_process("--model", str(tiny_omni_dir), "--node-id", "a", env=env)
    client, session = await new_session(node)
    await client.text_turn("what is the weather?")
    first = await client.reply(output_modalities=["text"], **GREEDY)
    first_usage = client.usage
    await client.ws.close()  # the connection drops; the node lives on
    await eventually(lambda: httpx.get(f"{node.url}/healthz").json()["active_sessions"] == 0,
                     "the dropped connection's session ends")

    client, resumed = await resume(node, session)
    assert resumed["type"] == "session.resumed"
    assert resumed["rebuilt_context"]["kept_live"] is True
    assert resumed["rebuilt_context"]["items"] == 2
    await client.text_turn("and tomorrow?")
    second = await client.reply(output_modalities=["text"], **GREEDY)
    assert first and second
    # The second reply ran on the whole first exchange, found in the KV as it was (no prefill
    # put it back: counted below). None of it came from the prefix cache: no system turn.
    usage = client.usage
    assert usage["input_tokens"] > first_usage["input_tokens"] + first_usage["output_tokens"]
    assert usage["input_token_details"]["cached_tokens"] == 0
    assert usage["truncation"] == {"type": "auto", "truncated_tokens": 0}
    await client.ws.close()

    # Every prefill of that session happened before its second reply began. One more turn of
    # another session, and the first report that counts it counts them all: two calls per text
    # turn (its item's mark, its text), one per reply (its mark), and none for putting a
    # context back.
    probe, _ = await new_session(node)
    await probe.text_turn("hello")
    await probe.reply(output_modalities=["text"], **GREEDY)
    await probe.ws.close()
    count = await eventually(lambda: (n := prefill_calls(node)) >= 9 and n,
                             "the probe's prefill reported")
    assert count == 9
