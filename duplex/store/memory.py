"""The in-memory registry of the embedded default: one process, nothing survives a restart."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import replace

from duplex.store.base import (
    EphemeralKey,
    Fenced,
    SessionNotFound,
    SessionRecord,
    StoredContext,
)


class MemoryStore:
    def __init__(self, tombstone_s: float = 3600.0, clock: Callable[[], float] = time.time) -> None:
        self.tombstone_s = tombstone_s
        self.clock = clock
        self._sessions: dict[str, SessionRecord] = {}
        self._keys: dict[str, EphemeralKey] = {}

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions) + len(self._keys)

    def _expire(self) -> None:
        now = self.clock()
        for sid, rec in list(self._sessions.items()):
            if now >= rec.deadline + self.tombstone_s:
                del self._sessions[sid]
            elif now >= rec.deadline and not rec.expired:
                rec.expired = True
                rec.conversation, rec.config, rec.context = [], {}, StoredContext()
        for h, key in list(self._keys.items()):
            if now >= key.expires_at:
                del self._keys[h]

    async def save(self, record: SessionRecord) -> bool:
        self._expire()
        cur = self._sessions.get(record.id)
        if cur is not None and not cur.expired and (
            cur.epoch > record.epoch or (cur.epoch == record.epoch and cur.owner != record.owner)
        ):
            raise Fenced(record.id, cur.epoch, cur.owner)
        fresh = cur is None or cur.expired
        held = StoredContext() if fresh else cur.context
        sent = record.context
        record = copy.deepcopy(replace(record, context=held))
        if sent is None:
            self._sessions[record.id] = record
            return fresh
        if any(n not in sent.parts and n not in held.parts for n in sent.names):
            self._sessions[record.id] = record
            return True
        # Only the parts the index names are kept: the others were left out or replaced.
        record.context = StoredContext(
            copy.deepcopy(sent.index),
            {n: sent.parts[n] if n in sent.parts else held.parts[n] for n in sent.names},
            tuple(sent.names))
        self._sessions[record.id] = record
        return False

    async def load(self, session_id: str) -> SessionRecord | None:
        self._expire()
        rec = self._sessions.get(session_id)
        return copy.deepcopy(rec) if rec is not None else None

    async def claim(self, session_id: str, node: str, expected_epoch: int,
                    deadline: float) -> SessionRecord:
        self._expire()
        rec = self._sessions.get(session_id)
        if rec is None or rec.expired:
            raise SessionNotFound(session_id)
        if rec.epoch != expected_epoch:
            raise Fenced(session_id, rec.epoch, rec.owner)
        rec.epoch += 1
        rec.owner = node
        rec.deadline = deadline
        return copy.deepcopy(rec)

    async def delete(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    async def put_key(self, secret_hash: str, key: EphemeralKey) -> None:
        self._expire()
        self._keys[secret_hash] = copy.deepcopy(key)

    async def take_key(self, secret_hash: str) -> EphemeralKey | None:
        self._expire()
        return self._keys.pop(secret_hash, None)

    async def close(self) -> None:
        pass
