"""Concurrent-session seats counted in a real redis-server by two nodes: atomic limits, leases
that renewals keep and death ends, and counting on the node alone while Redis is away."""

import asyncio
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex.access.limits import LocalSeats, Seat
from duplex.config import LimitsSettings
from duplex.store.redis_store import RedisStore
from duplex.store.seats import RedisSeats
from tests.waiting import eventually

pytestmark = pytest.mark.slow


@pytest.fixture
async def nodes(redis_server):
    made = []

    def node(renew_s=3600.0, **limits):
        store = RedisStore(redis_server.url)
        seats = RedisSeats(store.redis, LimitsSettings(**limits), renew_s)
        made.append((seats, store))
        return seats

    yield node
    for seats, store in made:
        await seats.close()
        await store.close()


def seat(n, key_id):
    return Seat(f"seat_{n}", key_id)


async def admitted(seats, one):
    return await seats.take(one) is None


async def test_two_nodes_share_both_limits(nodes):
    a, b = nodes(sessions=3, sessions_per_key=2), nodes(sessions=3, sessions_per_key=2)
    first = seat(1, "k1")
    assert await a.take(first) is None and await a.take(seat(2, "k1")) is None
    assert await b.take(seat(3, "k1")) == "limits.sessions_per_key"
    assert await b.take(seat(4, "k2")) is None
    assert await b.take(seat(5, "k2")) == "limits.sessions"
    assert await a.take(seat(5, "k2")) == "limits.sessions"
    assert set(a.held) == {"seat_1", "seat_2"} and set(b.held) == {"seat_4"}
    a.give_back(first)
    await eventually(lambda: admitted(b, seat(6, "k1")), "b takes the seat a gave back")


async def test_many_nodes_racing_for_the_last_seats_never_overshoot(nodes):
    racers = [nodes(sessions=5) for _ in range(4)]
    results = await asyncio.gather(*(racers[n % 4].take(seat(n, f"k{n}")) for n in range(20)))
    assert results.count(None) == 5
    assert sum(len(r.held) for r in racers) == 5


async def test_a_dead_nodes_seats_stop_counting_when_their_lease_ends(nodes):
    dead = nodes(sessions=1, lease_s=1.0)  # never renews
    other = nodes(sessions=1, lease_s=1.0)
    taken = time.monotonic()
    assert await dead.take(seat(1, "k")) is None
    assert await other.take(seat(2, "k")) == "limits.sessions"
    await eventually(lambda: admitted(other, seat(2, "k")), "the dead node's lease ends")
    assert time.monotonic() - taken >= 0.95


async def test_a_live_node_keeps_its_seats_past_the_lease(nodes, redis_server):
    live = nodes(renew_s=0.1, sessions=1, lease_s=0.5)
    other = nodes(sessions=1, lease_s=0.5)
    assert await live.take(seat(1, "k")) is None
    sync = redis.Redis.from_url(redis_server.url)
    first_end = sync.zscore("duplex:seats", "seat_1")

    def redis_ms():
        seconds, micros = sync.time()
        return seconds * 1000 + micros // 1000

    await eventually(lambda: redis_ms() > first_end + 500, "a lease past the first one's end")
    assert await other.take(seat(2, "k")) == "limits.sessions"


async def test_without_redis_a_node_counts_alone_and_writes_its_seats_back(nodes, redis_server):
    a, b, c = (nodes(sessions=2, lease_s=5.0) for _ in range(3))
    redis_server.stop()
    assert await a.take(seat(1, "k")) is None and await a.take(seat(2, "k")) is None
    assert a.local_only
    assert await a.take(seat(3, "k")) == "limits.sessions"
    passing = seat(5, "k")
    assert await c.take(passing) is None
    c.give_back(passing)
    redis_server.start()
    await a.renew()
    assert not a.local_only
    assert await b.take(seat(4, "k")) == "limits.sessions"
    # A node holding no seat still finds Redis back, and counts in it again.
    await c.renew()
    assert not c.local_only and await c.take(seat(6, "k")) == "limits.sessions"


ops = st.lists(st.tuples(st.integers(0, 1), st.booleans(), st.sampled_from(["k0", "k1", "k2"])),
               max_size=25)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, sessions=st.integers(0, 4), per_key=st.integers(0, 3))
async def test_two_nodes_count_as_one_node_would(redis_server, ops, sessions, per_key):
    """Any run of takes and give-backs on two nodes answers, take for take, as one node
    counting every seat of both would."""
    limits = LimitsSettings(sessions=sessions, sessions_per_key=per_key)
    stores = [RedisStore(redis_server.url) for _ in range(2)]
    await stores[0].redis.flushall()
    nodes = [RedisSeats(s.redis, limits, 3600.0) for s in stores]
    one_node = LocalSeats(limits)
    try:
        for n, (on, take, key_id) in enumerate(ops):
            node = nodes[on]
            if take:
                one = seat(n, key_id)
                assert await node.take(one) == await one_node.take(one)
            elif node.held:
                given_back = next(iter(node.held.values()))
                node.give_back(given_back)
                one_node.give_back(given_back)
                await node.settled()
        assert not any(node.local_only for node in nodes)
    finally:
        for node, store in zip(nodes, stores, strict=True):
            await node.close()
            await store.close()


async def test_a_resume_takes_its_sessions_seat_over_and_the_seat_counts_once(nodes):
    """A session resumed on node B while node A still holds its seat (A died, or has not
    noticed the drop yet): B's connection takes the seat over, A can neither renew it nor give
    it back, and the session counts once."""
    a, b = nodes(sessions=2, lease_s=5.0), nodes(sessions=2, lease_s=5.0)
    on_a = Seat("sess_x", "k")
    assert await a.take(on_a) is None
    own = Seat("sess_new", "k")
    assert await b.take(own) is None
    assert await b.take(seat(1, "k")) == "limits.sessions"
    # Resumed after its handshake: its own seat goes, the session's stays.
    moved = await b.move(own, "sess_x")
    assert (moved.id, set(b.held)) == ("sess_x", {"sess_x"})
    assert await b.take(seat(1, "k")) is None
    assert await a.take(seat(2, "k")) == "limits.sessions"
    a.give_back(on_a)
    await a.settled()
    assert await a.take(seat(2, "k")) == "limits.sessions"
    await a.renew()
    assert not a.held


async def test_a_resume_proved_at_the_handshake_is_admitted_at_the_limit(nodes):
    a, b = nodes(sessions=1, lease_s=5.0), nodes(sessions=1, lease_s=5.0)
    assert await a.take(Seat("sess_x", "k")) is None
    assert await b.take(Seat("sess_y", "k")) == "limits.sessions"
    # The same session, from a new connection: its seat is taken over, not a second one.
    again = Seat("sess_x", "k")
    assert await b.take(again) is None
    assert await b.take(Seat("sess_y", "k")) == "limits.sessions"
    await a.renew()
    assert not a.held
    b.give_back(again)
    await b.settled()
    assert await a.take(Seat("sess_y", "k")) is None
