"""Concurrent sessions counted across every node sharing one Redis, under leases.

Two sorted sets hold every node's seats: `{prefix}seats` (all of them) and
`{prefix}seats:{key_id}` (one API key's), each member a session's id scored by the Unix time
(ms) its lease ends; the hash `{prefix}seat_holders` names the connection holding each. A node
renews its seats every heartbeat; a seat whose lease has ended no longer counts, so a dead
node's sessions stop counting within `limits.lease_s`. Checking the limits and taking the seat
is one Lua script, so two nodes never both take the last seat. A resume moves the resuming
connection onto its session's seat (another script), wherever that was held: the session keeps
one place, and the connection it left can neither renew nor give back a seat no longer its
own. Lease ends come from Redis's clock, so the nodes' clocks may disagree.

If Redis cannot be reached, the node counts its own seats alone (the memory store's rule) and
writes them all again at its next renewal once Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from duplex.access.limits import Seat, limit_broken, move_held
from duplex.config import LimitsSettings

log = logging.getLogger("duplex.store.seats")

# Any failure of Redis, a refused password as much as a lost connection, leaves the node
# counting alone rather than refusing every session.
_UNREACHABLE = (RedisError, OSError)

# KEYS everywhere: all seats, the key's seats, the holders.
_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local function hold(id, holder)
  for i = 1, 2 do
    redis.call('ZADD', KEYS[i], now + lease, id)
    redis.call('PEXPIRE', KEYS[i], lease)
  end
  redis.call('HSET', KEYS[3], id, holder)
  redis.call('PEXPIRE', KEYS[3], lease)
end
"""

# ARGV: lease (ms), sessions limit, per-key limit, seat id, holder. Returns 0 (taken),
# 1 (limits.sessions) or 2 (limits.sessions_per_key). A seat that still counts is a resume's,
# proved at the handshake: it is taken over, and counts no more than it did.
_TAKE = _NOW_MS + """
for _, gone in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[3], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[4]) then
  local total, per_key = tonumber(ARGV[2]), tonumber(ARGV[3])
  if total > 0 and redis.call('ZCARD', KEYS[1]) >= total then return 1 end
  if per_key > 0 and redis.call('ZCARD', KEYS[2]) >= per_key then return 2 end
end
hold(ARGV[4], ARGV[5])
return 0
"""

# ARGV: lease (ms), the seat's id, its holder, the session's id. The connection gives its own
# seat up and holds the session's, wherever that was held: one less counts, or as many.
_MOVE = _NOW_MS + """
if redis.call('HGET', KEYS[3], ARGV[2]) == ARGV[3] then
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
end
hold(ARGV[4], ARGV[3])
return 0
"""

# ARGV: lease (ms), then seat id and holder pairs. Seats the sets lost (Redis restarted, or
# this node was cut off past its lease) are written again: they are live. Returns the ids
# another connection holds now (a resume moved it there): they are no longer this node's.
_RENEW = _NOW_MS + """
local lost = {}
for j = 2, #ARGV, 2 do
  local holder = redis.call('HGET', KEYS[3], ARGV[j])
  if holder and holder ~= ARGV[j + 1] then
    table.insert(lost, ARGV[j])
  else
    hold(ARGV[j], ARGV[j + 1])
  end
end
return lost
"""

# ARGV: the seat's id, its holder.
_GIVE_BACK = """
if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[2] then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
end
return 0
"""

_LIMITS = {1: "limits.sessions", 2: "limits.sessions_per_key"}


class RedisSeats:
    def __init__(self, client: aioredis.Redis, config: LimitsSettings, renew_s: float,
                 prefix: str = "duplex:", on_fallback: Callable[[], None] = lambda: None) -> None:
        self.client = client
        self.on_fallback = on_fallback
        """Told each time Redis is found unreachable and the node starts counting alone."""
        self.config = config
        self.renew_s = renew_s
        self.prefix = prefix
        self.held: dict[str, Seat] = {}
        self.local_only = False
        """Redis was unreachable at the last try: seats are counted on this node alone."""
        self._take = client.register_script(_TAKE)
        self._move = client.register_script(_MOVE)
        self._renew = client.register_script(_RENEW)
        self._give_back = client.register_script(_GIVE_BACK)
        # Renewals and removals take turns, so a renewal never writes back a seat just given up.
        self._turn = asyncio.Lock()
        self._renewer: asyncio.Task | None = None
        self._removals: set[asyncio.Task] = set()

    def _keys(self, key_id: str) -> list[str]:
        return [f"{self.prefix}seats", f"{self.prefix}seats:{key_id}",
                f"{self.prefix}seat_holders"]

    @property
    def _lease_ms(self) -> int:
        return int(self.config.lease_s * 1000)

    async def take(self, seat: Seat) -> str | None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever())
        # Once Redis is found gone, handshakes stop waiting on it; the renewals look for it.
        if self.local_only:
            limit = self._counted_alone(seat)
        else:
            try:
                code = await self._take(keys=self._keys(seat.key_id),
                                        args=[self._lease_ms, self.config.sessions,
                                              self.config.sessions_per_key, seat.id,
                                              seat.holder])
            except _UNREACHABLE as exc:
                self._unreachable(exc)
                limit = self._counted_alone(seat)
            else:
                self._reachable()
                limit = _LIMITS.get(int(code))
        if limit is None:
            self.held[seat.id] = seat
        return limit

    def _counted_alone(self, seat: Seat) -> str | None:
        if seat.id in self.held:
            return None
        return limit_broken(self.config, self.held.values(), seat.key_id)

    async def move(self, seat: Seat, session_id: str) -> Seat:
        async with self._turn:
            moved = move_held(self.held, seat, session_id)
            try:
                await self._move(keys=self._keys(seat.key_id),
                                 args=[self._lease_ms, seat.id, seat.holder, session_id])
            except _UNREACHABLE as exc:
                # Written with the next renewal once Redis is back.
                self._unreachable(exc)
            return moved

    def give_back(self, seat: Seat) -> None:
        if self.held.get(seat.id) != seat:
            return
        del self.held[seat.id]
        task = asyncio.get_running_loop().create_task(self._remove([seat]))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def settled(self) -> None:
        """Return once every seat given back so far is out of Redis (or found unreachable)."""
        await asyncio.gather(*self._removals, return_exceptions=True)

    async def _remove(self, seats: list[Seat]) -> None:
        async with self._turn:
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    for seat in seats:
                        await self._give_back(keys=self._keys(seat.key_id),
                                              args=[seat.id, seat.holder], client=pipe)
                    await pipe.execute()
            except _UNREACHABLE as exc:
                # Unrenewed, the seat stops counting when its lease ends.
                self._unreachable(exc)

    async def renew(self) -> None:
        """Push every held seat's lease forward by `lease_s` from now."""
        async with self._turn:
            by_key: dict[str, list[str]] = defaultdict(list)
            for seat in self.held.values():
                by_key[seat.key_id] += [seat.id, seat.holder]
            if not by_key and not self.local_only:
                return
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.ping()
                    for key_id, pairs in by_key.items():
                        await self._renew(keys=self._keys(key_id), args=[self._lease_ms, *pairs],
                                          client=pipe)
                    answers = await pipe.execute()
            except _UNREACHABLE as exc:
                self._unreachable(exc)
            else:
                self._reachable()
                for lost in answers[1:]:
                    for seat_id in lost:
                        self.held.pop(seat_id.decode() if isinstance(seat_id, bytes)
                                      else seat_id, None)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            await self.renew()

    def _unreachable(self, exc: Exception) -> None:
        if not self.local_only:
            self.on_fallback()
            log.warning("Redis unreachable (%s): concurrent sessions are counted on this node "
                        "alone until it is back", exc)
        self.local_only = True

    def _reachable(self) -> None:
        if self.local_only:
            log.info("Redis reachable again: concurrent sessions are counted across the cluster")
        self.local_only = False

    async def close(self) -> None:
        """Stop renewing and give every held seat back (the other nodes may use them now)."""
        if self._renewer is not None:
            self._renewer.cancel()
        await self.settled()
        seats, self.held = list(self.held.values()), {}
        if seats:
            await self._remove(seats)
