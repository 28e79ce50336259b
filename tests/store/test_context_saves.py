"""A long session's model context saved through the keeper into both registries: each save
writes what is new, not the whole context; the registry holds only what the index names; a
resume on another node rebuilds it exactly; and a session past its retention leaves nothing."""


import numpy as np

from duplex.bench.synth import babble
from duplex.media.fir import FirResampler, InputResamplers
from duplex.store import SessionRegistry, StoredContext
from duplex.store.context import AudioSpan, ContextRecord, ReplySpan, TextSpan, quantize
from duplex.store.keeper import SessionKeeper
from duplex.store.redis_store import RedisStore
from tests.store.conftest import FakeClock
from tests.waiting import eventually

RATE = 24000
IN_RATE = 16000
STEP = IN_RATE // 2
"""Audio pushed between two saves: half a second."""
CAP = 1_000_000


class Call:
    """A session's context as the engine is handed it: 12 s of speech, then a text turn and a
    reply heard in full, and again; saved through a keeper after every half second."""

    def __init__(self, store, node: str, retention_s: float) -> None:
        self.registry = SessionRegistry(store, node, retention_s, clock=store.clock,
                                        context_max_bytes=CAP)
        self.lease, self.token = self.registry.new_lease("sess_long")
        self.record = ContextRecord(IN_RATE, RATE, RATE, CAP)
        self.record.instruct("You are terse.", ())
        self.resampler = FirResampler(RATE, IN_RATE)
        self.pushed: list[np.ndarray] = []
        """Each audio turn's samples, as the model heard them."""
        self.keeper = SessionKeeper(self.registry, self.lease, self.snapshot, lambda: None, 1.0)
        self.steps = 0

    def snapshot(self):
        return [], {}, self.record.to_record(lambda core_id: None,
                                              InputResamplers(self.resampler.state(), None))

    def step(self) -> None:
        self.steps += 1
        if self.steps % 24 == 0:
            self.record.text(f"turn {self.steps}", "user")
            self.record.reply(self.steps, 1, "", ())
            self.record.tokens(1, tuple(range(self.steps, self.steps + 20)), 0, 0)
            self.pushed.append(np.zeros(0, np.float32))
        pcm = quantize(babble(STEP, IN_RATE, seed=self.steps))
        self.resampler.process(np.zeros(STEP * 3 // 2, np.float32))  # its state is saved too
        self.record.audio(pcm)
        if not self.pushed:
            self.pushed.append(pcm)
        else:
            self.pushed[-1] = np.concatenate([self.pushed[-1], pcm])


class Resuming:
    """A new connection's session, saved through its keeper until it resumes another."""

    def __init__(self, registry: SessionRegistry) -> None:
        self.record = ContextRecord(IN_RATE, RATE, RATE, CAP)
        self.record.instruct("You are terse.", ())
        self.keeper = SessionKeeper(registry, registry.new_lease("sess_fresh")[0],
                                    self.snapshot, lambda: None, 1.0)

    def snapshot(self):
        # A resumed session's input goes on from where the record's resamplers stood.
        return [], {}, self.record.to_record(lambda core_id: None, self.record.resamplers)


def received(store) -> list[tuple[str, StoredContext | None]]:
    """Each save the store takes from now on: the session and the context sent with it."""
    sent = []
    save = store.save

    async def counted(record):
        sent.append((record.id, record.context))
        return await save(record)

    store.save = counted
    return sent


def rebuilt(context: ContextRecord):
    """What a rebuild hands the engine, in order."""
    out = []
    for span in context.spans:
        if isinstance(span, AudioSpan):
            out.append(("audio", span.pcm().tobytes()))
        elif isinstance(span, TextSpan):
            out.append(("text", span.text))
        elif isinstance(span, ReplySpan):
            out.append(("reply", tuple(span.heard_ids(None, 1.0))))
    return out


async def test_saves_write_what_is_new_and_stay_flat_through_a_long_call(redis_server):
    store = RedisStore(redis_server.url)
    call = Call(store, "a", retention_s=30.0)
    await call.keeper.start()
    written, index_bytes = [], []
    for _ in range(240):  # two minutes
        call.step()
        before = (await store.redis.info("stats"))["total_net_input_bytes"]
        await call.keeper.save()
        written.append((await store.redis.info("stats"))["total_net_input_bytes"] - before)
        index_bytes.append(await store.redis.hstrlen("duplex:s:sess_long", "context"))
    # The registry holds just what the index names, within the cap.
    held = await store.redis.hgetall("duplex:c:sess_long")
    assert set(held) == set(call.snapshot()[2].names)
    assert CAP / 2 < sum(map(len, held.values())) <= CAP + 20_000
    # The cap holds the context at ~1 MB from about 35 s on; a whole-record rewrite would
    # send that on every save. A save sends the index and the half second of audio since the
    # one before (~15 kB of base64 FLAC); the save that fills a 10 s block sends the block.
    blocks = [len(text) for text in held.values() if text.startswith(f"{10 * IN_RATE}:")]
    assert blocks and max(written) < max(blocks) + 20_000
    assert sum(n > 20_000 for n in written[120:]) == 5  # one block a turn, and no other
    # Flat: the last saves write no more than the early ones, and the index stopped growing
    # when the cap began to hold.
    assert np.median(written[200:]) <= 1.1 * np.median(written[20:60]) < 20_000
    assert max(index_bytes[200:]) <= max(index_bytes[60:100]) + 200 and index_bytes[-1] < 2000
    await store.close()


async def test_a_long_call_resumes_exactly_elsewhere_and_leaves_nothing_after_retention(store):
    retention = 2.0
    call = Call(store, "a", retention)
    await call.keeper.start()
    for _ in range(120):
        call.step()
        await call.keeper.save()
        if isinstance(store.clock, FakeClock):
            store.clock.now += 0.5
    expected = rebuilt(ContextRecord.from_record(call.snapshot()[2], IN_RATE, RATE, RATE, CAP))

    node_b = SessionRegistry(store, "b", retention, clock=store.clock, context_max_bytes=CAP)
    # A connection to node B opens a session of its own, then resumes the long one.
    fresh = Resuming(node_b)
    await fresh.keeper.start()
    lease, record = await node_b.resume("sess_long", call.token)
    context = ContextRecord.from_record(record.context, IN_RATE, RATE, RATE, CAP)
    assert rebuilt(context) == expected
    # The newest audio turn comes back as the very samples the model heard.
    assert expected[-1] == ("audio", np.round(call.pushed[-1] * 32767).astype("<i2").tobytes())
    state = call.resampler.state()
    model = context.resamplers.model
    assert context.left_out > 0 and (model.fed, model.emitted) == (
        state.fed, state.emitted) and np.array_equal(model.tail, state.tail)

    # Node A lost it: its next save (and any part in it) is refused.
    call.step()
    await call.keeper.save()
    assert call.keeper.fenced
    again = (await store.load("sess_long")).context
    assert (again.index, again.parts) == (record.context.index, record.context.parts)

    # Node B goes on recording into it; its saves name on from where A stopped, and its
    # first sends only those: the registry already holds what the claim found.
    context.audio(quantize(babble(STEP, IN_RATE, seed=999)))
    context.text("after the resume", "user")
    sent = received(store)
    await fresh.keeper.switch(lease, record.context)
    fresh.record = context
    await fresh.keeper.stop()
    loaded = (await store.load("sess_long")).context
    assert await store.load("sess_fresh") is None
    first = next(c for sid, c in sent if sid == "sess_long")
    assert first.index == loaded.index and set(first.names) == set(loaded.names)
    assert set(first.parts) == set(loaded.names) - set(record.context.names)
    assert 0 < sum(map(len, first.parts.values())) < 20_000
    direct = context.to_record(lambda core_id: None)
    assert rebuilt(ContextRecord.from_record(loaded, IN_RATE, RATE, RATE, CAP)) == rebuilt(
        ContextRecord.from_record(direct, IN_RATE, RATE, RATE, CAP))
    assert rebuilt(context)[-1] == ("text", "after the resume")
    new = set(loaded.names) - set(record.context.names)
    assert new and all(int(n, 16) > record.context.index["named"] for n in new)

    async def nothing_left():
        if isinstance(store, RedisStore):
            return await store.redis.dbsize() == 0
        store.clock.now += 0.5
        return len(store) == 0

    await eventually(nothing_left, "the session, its tombstone and its context parts expired",
                     retention + 5)



async def test_a_resumed_session_sends_its_whole_context_when_the_registry_lost_it(store):
    call = Call(store, "a", 30.0)
    await call.keeper.start()
    for _ in range(24):
        call.step()
        await call.keeper.save()
    node_b = SessionRegistry(store, "b", 30.0, clock=store.clock, context_max_bytes=CAP)
    fresh = Resuming(node_b)  # saved only when the test says (no heartbeat)
    lease, record = await node_b.resume("sess_long", call.token)
    await fresh.keeper.switch(lease, record.context)
    fresh.record = ContextRecord.from_record(record.context, IN_RATE, RATE, RATE, CAP)
    await store.delete("sess_long")  # a registry restarted without its data

    sent = received(store)
    await fresh.keeper.save()
    await fresh.keeper.save()
    whole = fresh.record.to_record(lambda core_id: None)
    assert [set(c.parts) for _, c in sent] == [set(), set(whole.names)]
    loaded = (await store.load("sess_long")).context
    assert rebuilt(ContextRecord.from_record(loaded, IN_RATE, RATE, RATE, CAP)) == rebuilt(
        fresh.record)


async def test_a_resume_that_found_an_older_record_puts_its_own_context_back(store):
    """The losing node saved once more between the resume's load and its claim: the registry
    holds parts the resumed context never had, which its first save drops."""
    call = Call(store, "a", 30.0)
    await call.keeper.start()
    for _ in range(4):
        call.step()
        await call.keeper.save()
    found = (await store.load("sess_long")).context
    call.step()
    call.record.text("heard only on node A", "user")
    await call.keeper.save()
    node_b = SessionRegistry(store, "b", 30.0, clock=store.clock, context_max_bytes=CAP)
    fresh = Resuming(node_b)
    lease, _ = await node_b.resume("sess_long", call.token)
    await fresh.keeper.switch(lease, found)
    fresh.record = ContextRecord.from_record(found, IN_RATE, RATE, RATE, CAP)

    sent = received(store)
    await fresh.keeper.save()
    assert [set(c.parts) for _, c in sent] == [set()]
    loaded = (await store.load("sess_long")).context
    assert loaded.parts == found.parts and rebuilt(
        ContextRecord.from_record(loaded, IN_RATE, RATE, RATE, CAP)) == rebuilt(fresh.record)
