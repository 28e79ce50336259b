"""Concurrent sessions counted across every node sharing one Redis, under leases.

Two sorted sets hold every node's seats: `{prefix}seats` (all of them) and
`{prefix}seats:{key_id}` (one API key's), each member scored by the Unix time (ms) its lease
ends. A node renews its seats every heartbeat; a seat whose lease has ended no longer counts,
so a dead node's sessions stop counting within `limits.lease_s`. Checking the limits and taking
the seat is one Lua script, so two nodes never both take the last seat. Lease ends come from
Redis's clock, so the nodes' clocks may disagree.

If Redis cannot be reached, the node counts its own seats alone (the memory store's rule) and
writes them all again at its next renewal once Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from duplex.access.limits import Seat, limit_broken
from duplex.config import LimitsSettings

log = logging.getLogger("duplex.store.seats")

# Any failure of Redis, a refused password as much as a lost connection, leaves the node
# counting alone rather than refusing every session.
_UNREACHABLE = (RedisError, OSError)

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: all seats, the key's seats. ARGV: lease (ms), sessions limit, per-key limit, seat id.
# Returns 0 (taken), 1 (limits.sessions) or 2 (limits.sessions_per_key).
_TAKE = _NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local total, per_key = tonumber(ARGV[2]), tonumber(ARGV[3])
if total > 0 and redis.call('ZCARD', KEYS[1]) >= total then return 1 end
if per_key > 0 and redis.call('ZCARD', KEYS[2]) >= per_key then return 2 end
for i = 1, 2 do
  redis.call('ZADD', KEYS[i], now + tonumber(ARGV[1]), ARGV[4])
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
end
return 0
"""

# KEYS: all seats, the key's seats. ARGV: lease (ms), seat ids. Seats the sets lost (Redis
# restarted, or this node was cut off past its lease) are written again: they are live.
_RENEW = _NOW_MS + """
for i = 1, 2 do
  for j = 2, #ARGV do
    redis.call('ZADD', KEYS[i], now + tonumber(ARGV[1]), ARGV[j])
  end
  redis.call('PEXPIRE', KEYS[i], ARGV[1])
end
return 0
"""

_LIMITS = {1: "limits.sessions", 2: "limits.sessions_per_key"}


class RedisSeats:
    def __init__(self, client: aioredis.Redis, config: LimitsSettings, renew_s: float,
                 prefix: str = "duplex:") -> None:
        self.client = client
        self.config = config
        self.renew_s = renew_s
        self.prefix = prefix
        self.held: dict[str, Seat] = {}
        self.local_only = False
        """Redis was unreachable at the last try: seats are counted on this node alone."""
        self._take = client.register_script(_TAKE)
        self._renew = client.register_script(_RENEW)
        # Renewals and removals take turns, so a renewal never writes back a seat just given up.
        self._turn = asyncio.Lock()
        self._renewer: asyncio.Task | None = None
        self._removals: set[asyncio.Task] = set()

    def _keys(self, key_id: str) -> list[str]:
        return [f"{self.prefix}seats", f"{self.prefix}seats:{key_id}"]

    @property
    def _lease_ms(self) -> int:
        return int(self.config.lease_s * 1000)

    async def take(self, seat: Seat) -> str | None:
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever())
        # Once Redis is found gone, handshakes stop waiting on it; the renewals look for it.
        if self.local_only:
            limit = limit_broken(self.config, self.held.values(), seat.key_id)
        else:
            try:
                code = await self._take(keys=self._keys(seat.key_id),
                                        args=[self._lease_ms, self.config.sessions,
                                              self.config.sessions_per_key, seat.id])
            except _UNREACHABLE as exc:
                self._unreachable(exc)
                limit = limit_broken(self.config, self.held.values(), seat.key_id)
            else:
                self._reachable()
                limit = _LIMITS.get(int(code))
        if limit is None:
            self.held[seat.id] = seat
        return limit

    def give_back(self, seat: Seat) -> None:
        if self.held.pop(seat.id, None) is None:
            return
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
                        for key in self._keys(seat.key_id):
                            pipe.zrem(key, seat.id)
                    await pipe.execute()
            except _UNREACHABLE as exc:
                # Unrenewed, the seat stops counting when its lease ends.
                self._unreachable(exc)

    async def renew(self) -> None:
        """Push every held seat's lease forward by `lease_s` from now."""
        async with self._turn:
            by_key: dict[str, list[str]] = defaultdict(list)
            for seat in self.held.values():
                by_key[seat.key_id].append(seat.id)
            if not by_key and not self.local_only:
                return
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.ping()
                    for key_id, ids in by_key.items():
                        await self._renew(keys=self._keys(key_id), args=[self._lease_ms, *ids],
                                          client=pipe)
                    await pipe.execute()
            except _UNREACHABLE as exc:
                self._unreachable(exc)
            else:
                self._reachable()

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            await self.renew()

    def _unreachable(self, exc: Exception) -> None:
        if not self.local_only:
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
