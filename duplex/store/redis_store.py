"""The Redis registry, shared by every node of a deployment.

A session is a hash `{prefix}s:{id}` that expires at its deadline, plus a tombstone
`{prefix}t:{id}` (the secret's hash and the deadline) that outlives it by `tombstone_s`.
Claims and fenced saves are Lua scripts, so the epoch check and the write are one atomic step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from duplex.store.base import (
    EphemeralKey,
    Fenced,
    SessionNotFound,
    SessionRecord,
    StoreUnavailable,
)

# KEYS: session, tombstone. ARGV: owner, epoch, secret_hash, conversation, config, deadline,
# created_at, session expiry (ms), tombstone (json), tombstone expiry (ms), context ('': the
# stored one is still current).
_SAVE = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'owner')
if cur[1] then
  local e = tonumber(cur[1])
  local mine = tonumber(ARGV[2])
  if e > mine or (e == mine and cur[2] ~= ARGV[1]) then
    return {0, cur[1], cur[2]}
  end
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'epoch', ARGV[2], 'secret_hash', ARGV[3],
           'conversation', ARGV[4], 'config', ARGV[5], 'deadline', ARGV[6], 'created_at', ARGV[7])
if ARGV[11] ~= '' then redis.call('HSET', KEYS[1], 'context', ARGV[11]) end
redis.call('PEXPIREAT', KEYS[1], ARGV[8])
redis.call('SET', KEYS[2], ARGV[9], 'PXAT', ARGV[10])
if cur[1] then return {1} end
return {2}
"""

# KEYS: session, tombstone. ARGV: node, expected epoch, deadline, session expiry (ms),
# tombstone (json), tombstone expiry (ms).
_CLAIM = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'owner')
if not cur[1] then return {-1} end
if tonumber(cur[1]) ~= tonumber(ARGV[2]) then return {0, cur[1], cur[2]} end
local epoch = tonumber(cur[1]) + 1
redis.call('HSET', KEYS[1], 'epoch', epoch, 'owner', ARGV[1], 'deadline', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[4])
redis.call('SET', KEYS[2], ARGV[5], 'PXAT', ARGV[6])
return {1, epoch}
"""

_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisStore:
    def __init__(self, url: str, *, tombstone_s: float = 3600.0, prefix: str = "duplex:",
                 timeout_s: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        # No retries and short timeouts: a session loop must never stall on a dead Redis;
        # the caller retries on its next heartbeat instead.
        self.redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True,
        )
        self.tombstone_s = tombstone_s
        self.prefix = prefix
        self.clock = clock
        self._save = self.redis.register_script(_SAVE)
        self._claim = self.redis.register_script(_CLAIM)

    def _keys(self, session_id: str) -> list[str]:
        return [f"{self.prefix}s:{session_id}", f"{self.prefix}t:{session_id}"]

    def _tomb(self, secret_hash: str, deadline: float) -> list[str | int]:
        return [json.dumps({"secret_hash": secret_hash, "deadline": deadline}),
                int((deadline + self.tombstone_s) * 1000)]

    async def save(self, record: SessionRecord) -> bool:
        args = [record.owner, record.epoch, record.secret_hash, json.dumps(record.conversation),
                json.dumps(record.config), repr(record.deadline), repr(record.created_at),
                int(record.deadline * 1000), *self._tomb(record.secret_hash, record.deadline),
                "" if record.context is None else json.dumps(record.context)]
        try:
            result = await self._save(keys=self._keys(record.id), args=args)
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc
        if result[0] == 0:
            raise Fenced(record.id, int(result[1]), result[2])
        return result[0] == 2

    async def load(self, session_id: str) -> SessionRecord | None:
        skey, tkey = self._keys(session_id)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                data, tomb = await pipe.hgetall(skey).get(tkey).execute()
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc
        if data and float(data["deadline"]) > self.clock():
            return SessionRecord(
                id=session_id, owner=data["owner"], epoch=int(data["epoch"]),
                secret_hash=data["secret_hash"], deadline=float(data["deadline"]),
                created_at=float(data["created_at"]),
                conversation=json.loads(data["conversation"]), config=json.loads(data["config"]),
                context=json.loads(data.get("context", "{}")),
            )
        if tomb:
            # The hash may outlive its deadline by Redis's expiry granularity; the tombstone
            # tells the same story either way.
            t = json.loads(tomb)
            return SessionRecord(id=session_id, owner="", epoch=-1, secret_hash=t["secret_hash"],
                                 deadline=t["deadline"], created_at=0.0, expired=True)
        return None

    async def claim(self, session_id: str, node: str, expected_epoch: int,
                    deadline: float) -> SessionRecord:
        record = await self.load(session_id)
        if record is None or record.expired:
            raise SessionNotFound(session_id)
        args = [node, expected_epoch, repr(deadline), int(deadline * 1000),
                *self._tomb(record.secret_hash, deadline)]
        try:
            result = await self._claim(keys=self._keys(session_id), args=args)
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc
        if result[0] == -1:
            raise SessionNotFound(session_id)
        if result[0] == 0:
            raise Fenced(session_id, int(result[1]), result[2])
        record.epoch, record.owner, record.deadline = int(result[1]), node, deadline
        return record

    async def delete(self, session_id: str) -> None:
        try:
            await self.redis.delete(*self._keys(session_id))
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def put_key(self, secret_hash: str, key: EphemeralKey) -> None:
        value = json.dumps({"key_id": key.key_id, "expires_at": key.expires_at,
                            "session_id": key.session_id, "session": key.session})
        try:
            await self.redis.set(f"{self.prefix}k:{secret_hash}", value,
                                 pxat=int(key.expires_at * 1000))
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def take_key(self, secret_hash: str) -> EphemeralKey | None:
        try:
            value = await self.redis.getdel(f"{self.prefix}k:{secret_hash}")
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc
        if value is None:
            return None
        data = json.loads(value)
        if data["expires_at"] <= self.clock():
            return None
        return EphemeralKey(data["key_id"], data["expires_at"], data["session_id"], data["session"])

    async def close(self) -> None:
        await self.redis.aclose()
