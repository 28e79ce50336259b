"""Both registry backends against one contract: fencing, reconcile, expiry, ephemeral keys."""

import asyncio
import time

import pytest

from duplex.store import (
    EphemeralKey,
    Fenced,
    ResumeError,
    SessionNotFound,
    SessionRecord,
    SessionRegistry,
    StoredContext,
    StoreUnavailable,
    hash_secret,
)
from duplex.store.redis_store import RedisStore
from tests.store.conftest import FakeClock
from tests.waiting import eventually


async def after(store, seconds: float, holds) -> None:
    """Let `seconds` pass on the store's clock, then wait (with a deadline) until `holds()`:
    a fake clock jumps at once; Redis's own expiry is waited for."""
    if isinstance(store.clock, FakeClock):
        store.clock.now += seconds
    await eventually(holds, f"so, {seconds + 5:g} s later", seconds + 5)


def record(epoch=1, owner="a", deadline_in=30.0, conversation=None, now=None, context=None):
    now = time.time() if now is None else now
    return SessionRecord(id="sess_1", owner=owner, epoch=epoch, secret_hash=hash_secret("rt_x"),
                         deadline=now + deadline_in, created_at=now,
                         conversation=conversation or [{"id": "item_1", "role": "user"}],
                         context=context)


def context(names, sent=None):
    """An index naming `names`, sending the parts `sent` (all of them by default)."""
    sent = names if sent is None else sent
    return StoredContext({"entries": list(names)}, {n: f"part {n}" for n in sent}, tuple(names))


def same(a, b):
    """The same index and parts (the order a registry lists them in aside)."""
    return (a.index, a.parts, set(a.names)) == (b.index, b.parts, set(b.names))


async def held_parts(store, session_id="sess_1"):
    """The context parts the registry holds for the session, loaded or not."""
    if isinstance(store, RedisStore):
        return await store.redis.hgetall(f"duplex:c:{session_id}")
    rec = store._sessions.get(session_id)
    return rec.context.parts if rec is not None else {}


async def test_claim_bumps_the_epoch_and_fences_the_old_owner(store):
    await store.save(record())
    claimed = await store.claim("sess_1", "b", 1, time.time() + 30)
    assert (claimed.epoch, claimed.owner) == (2, "b")
    assert claimed.conversation == [{"id": "item_1", "role": "user"}]
    with pytest.raises(Fenced) as info:
        await store.save(record(epoch=1, owner="a"))
    assert (info.value.epoch, info.value.owner) == (2, "b")
    # Two claims from the same epoch: exactly one wins.
    with pytest.raises(Fenced):
        await store.claim("sess_1", "c", 1, time.time() + 30)
    await store.save(record(epoch=2, owner="b", conversation=[{"id": "item_2"}]))
    assert (await store.load("sess_1")).conversation == [{"id": "item_2"}]
    # The same epoch from another node is not the owner either.
    with pytest.raises(Fenced):
        await store.save(record(epoch=2, owner="c"))


async def test_concurrent_claims_have_one_winner(store):
    await store.save(record())
    results = await asyncio.gather(
        *(store.claim("sess_1", f"n{i}", 1, time.time() + 30) for i in range(8)),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, SessionRecord)]
    assert len(winners) == 1 and winners[0].epoch == 2
    assert all(isinstance(r, Fenced) for r in results if r is not winners[0])


async def test_a_missing_record_is_written_again_by_its_owner(store):
    await store.save(record(epoch=3))
    await store.delete("sess_1")
    assert await store.load("sess_1") is None
    with pytest.raises(SessionNotFound):
        await store.claim("sess_1", "b", 3, time.time() + 30)
    await store.save(record(epoch=3))
    assert (await store.load("sess_1")).epoch == 3


async def test_a_save_without_the_context_keeps_the_stored_one_and_says_when_there_is_none(store):
    assert await store.save(record(context=context(["1", "2"]))) is False
    assert await store.save(record(conversation=[{"id": "item_2"}])) is False
    loaded = await store.load("sess_1")
    assert loaded.conversation == [{"id": "item_2"}]
    assert same(loaded.context, context(["1", "2"]))
    # A registry that lost the record: the save that leaves the context out is told so.
    await store.delete("sess_1")
    assert await held_parts(store) == {}
    assert await store.save(record()) is True
    assert (await store.load("sess_1")).context == StoredContext()


async def test_a_save_writes_only_new_parts_and_the_registry_keeps_just_those_named(store):
    await store.save(record(context=context(["1", "2", "3"])))
    # "2" is still held; "1" and "3" are no longer named; "4" is new.
    assert await store.save(record(context=context(["2", "4"], sent=["4"]))) is False
    assert await held_parts(store) == {"2": "part 2", "4": "part 4"}
    assert same((await store.load("sess_1")).context, context(["2", "4"]))
    # An index naming a part that was neither sent nor held is refused whole: the stored
    # context stays as it was, and the caller is told to send everything.
    assert await store.save(record(context=context(["2", "5", "6"], sent=["6"]))) is True
    assert await held_parts(store) == {"2": "part 2", "4": "part 4"}
    assert same((await store.load("sess_1")).context, context(["2", "4"]))


async def test_a_fenced_owner_writes_no_part(store):
    await store.save(record(context=context(["1"])))
    await store.claim("sess_1", "b", 1, time.time() + 30)
    with pytest.raises(Fenced):
        await store.save(record(epoch=1, owner="a", context=context(["1", "2"], sent=["2"])))
    assert await held_parts(store) == {"1": "part 1"}
    assert same((await store.load("sess_1")).context, context(["1"]))


async def test_expiry_keeps_a_tombstone_then_releases_everything(store):
    now = store.clock()
    await store.save(record(deadline_in=0.3, now=now, context=context(["1", "2"])))
    await store.put_key(hash_secret("ek_1"), EphemeralKey("key", now + 0.3, "sess_k"))
    await store.put_key(hash_secret("ek_2"), EphemeralKey("key", now + 0.3, "sess_l"))
    assert (await store.take_key(hash_secret("ek_1"))).session_id == "sess_k"
    assert await store.take_key(hash_secret("ek_1")) is None

    async def tombstoned():
        loaded = await store.load("sess_1")
        return loaded is not None and loaded.expired and store.clock() >= now + 0.3

    await after(store, 0.35, tombstoned)
    tomb = await store.load("sess_1")
    assert tomb.expired and tomb.conversation == [] and tomb.secret_hash == hash_secret("rt_x")
    assert await held_parts(store) == {}
    assert await store.take_key(hash_secret("ek_2")) is None
    with pytest.raises(SessionNotFound):
        await store.claim("sess_1", "b", 1, time.time() + 30)

    async def gone():
        return await store.load("sess_1") is None

    await after(store, 0.45, gone)
    if isinstance(store, RedisStore):
        assert await store.redis.dbsize() == 0
    else:
        assert len(store) == 0


async def test_registry_resume_codes(store):
    registry = SessionRegistry(store, "a", retention_s=0.3, clock=store.clock)
    lease, token = registry.new_lease("sess_r")
    assert token.startswith("rt_") and token not in repr(lease)
    await registry.save(lease, [{"id": "item_1"}], {"instructions": "hi"})
    other = SessionRegistry(store, "b", retention_s=0.3, clock=store.clock)
    with pytest.raises(ResumeError, match="does not exist") as info:
        await other.resume("sess_nope", token)
    assert info.value.code == "session_not_found"
    with pytest.raises(ResumeError) as info:
        await other.resume("sess_r", "rt_wrong")
    assert info.value.code == "resume_token_invalid"
    new_lease, rec = await other.resume("sess_r", token)
    assert new_lease.epoch == lease.epoch + 1 and rec.owner == "b"
    assert rec.conversation == [{"id": "item_1"}] and rec.config == {"instructions": "hi"}
    with pytest.raises(Fenced):
        await registry.save(lease, [], {})

    async def past_retention():
        loaded = await store.load("sess_r")
        return loaded.expired or loaded.deadline <= store.clock()

    await after(store, 0.35, past_retention)
    with pytest.raises(ResumeError) as info:
        await other.resume("sess_r", token)
    assert info.value.code == "session_expired"


async def test_redis_down_is_unavailable_not_a_hang(redis_server):
    store = RedisStore(redis_server.url, timeout_s=0.5)
    await store.save(record())
    redis_server.stop()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        await store.save(record())
    with pytest.raises(StoreUnavailable):
        await store.load("sess_1")
    assert time.monotonic() - t0 < 2
    redis_server.start()
    assert await store.load("sess_1") is None
    await store.save(record())
    assert (await store.load("sess_1")).epoch == 1
    await store.close()
