"""The Redis registry, shared by every node of a deployment.

A session is a hash `{prefix}s:{id}` that expires at its deadline, plus a tombstone
`{prefix}t:{id}` (the secret's hash and the deadline) that outlives it by `tombstone_s`. The
parts of its model context are the fields of a hash `{prefix}c:{id}` that expires with it; the
session hash's `context` field is their index. Claims and fenced saves are Lua scripts, so the
epoch check and the write (parts included) are one atomic step; a save deletes the parts its
index no longer names, so the parts hash holds exactly what the index names.
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
    StoredContext,
    StoreUnavailable,
)

# KEYS: session, tombstone, context parts. ARGV: owner, epoch, secret_hash, conversation,
# config, deadline, created_at, session expiry (ms), tombstone (json), tombstone expiry (ms),
# context index ('': the stored one is still current), n, the n part names the index names,
# then name and text of each part sent. Returns {0, epoch, owner} when fenced, {2} when the
# registry lacks context the save took as held (nothing of the context written), else {1}.
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
local lacking = not cur[1]
if ARGV[11] ~= '' then
  local n = tonumber(ARGV[12])
  local sent, named = {}, {}
  for i = 13 + n, #ARGV, 2 do sent[ARGV[i]] = true end
  lacking = false
  for i = 13, 12 + n do
    named[ARGV[i]] = true
    if not sent[ARGV[i]] and redis.call('HEXISTS', KEYS[3], ARGV[i]) == 0 then lacking = true end
  end
  if not lacking then
    for i = 13 + n, #ARGV, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
    for _, name in ipairs(redis.call('HKEYS', KEYS[3])) do
      if not named[name] then redis.call('HDEL', KEYS[3], name) end
    end
    redis.call('HSET', KEYS[1], 'context', ARGV[11])
  end
end
redis.call('PEXPIREAT', KEYS[1], ARGV[8])
redis.call('PEXPIREAT', KEYS[3], ARGV[8])
redis.call('SET', KEYS[2], ARGV[9], 'PXAT', ARGV[10])
if lacking then return {2} end
return {1}
"""

# KEYS: session, tombstone, context parts. ARGV: node, expected epoch, deadline, session
# expiry (ms), tombstone (json), tombstone expiry (ms).
_CLAIM = """
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'owner')
if not cur[1] then return {-1} end
if tonumber(cur[1]) ~= tonumber(ARGV[2]) then return {0, cur[1], cur[2]} end
local epoch = tonumber(cur[1]) + 1
redis.call('HSET', KEYS[1], 'epoch', epoch, 'owner', ARGV[1], 'deadline', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[4])
redis.call('PEXPIREAT', KEYS[3], ARGV[4])
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
        """The session's hash, its tombstone and its context's parts."""
        return [f"{self.prefix}{kind}:{session_id}" for kind in "stc"]

    def _tomb(self, secret_hash: str, deadline: float) -> list[str | int]:
        return [json.dumps({"secret_hash": secret_hash, "deadline": deadline}),
                int((deadline + self.tombstone_s) * 1000)]

    async def save(self, record: SessionRecord) -> bool:
        args = [record.owner, record.epoch, record.secret_hash, json.dumps(record.conversation),
                json.dumps(record.config), repr(record.deadline), repr(record.created_at),
                int(record.deadline * 1000), *self._tomb(record.secret_hash, record.deadline)]
        context = record.context
        if context is None:
            args.append("")
        else:
            args += [json.dumps(context.index), len(context.names), *context.names]
            for name, text in context.parts.items():
                args += [name, text]
        try:
            result = await self._save(keys=self._keys(record.id), args=args)
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc
        if result[0] == 0:
            raise Fenced(record.id, int(result[1]), result[2])
        return result[0] == 2

    async def load(self, session_id: str) -> SessionRecord | None:
        skey, tkey, ckey = self._keys(session_id)
        try:
            # One transaction: the index and the parts it names, as one save left them.
            async with self.redis.pipeline(transaction=True) as pipe:
                data, tomb, parts = await pipe.hgetall(skey).get(tkey).hgetall(ckey).execute()
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc
        if data and float(data["deadline"]) > self.clock():
            return SessionRecord(
                id=session_id, owner=data["owner"], epoch=int(data["epoch"]),
                secret_hash=data["secret_hash"], deadline=float(data["deadline"]),
                created_at=float(data["created_at"]),
                conversation=json.loads(data["conversation"]), config=json.loads(data["config"]),
                context=StoredContext(json.loads(data.get("context", "{}")), parts,
                                      tuple(parts)),
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
