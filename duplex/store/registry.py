"""What a node does with the registry: lease new sessions, save them under their fencing
epoch, resume them from another connection (or node), and issue ephemeral keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from duplex.store.base import (
    EphemeralKey,
    Fenced,
    SessionNotFound,
    SessionRecord,
    SessionStore,
    StoredContext,
    StoreUnavailable,
    hash_secret,
    new_secret,
    secret_matches,
)
from duplex.store.live import LiveStates


class ResumeError(Exception):
    """A resume refused; `code` is the Realtime error code the client sees."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Lease:
    """This node's hold on one session: the epoch it writes under."""

    session_id: str
    epoch: int
    secret_hash: str
    created_at: float


class SessionRegistry:
    def __init__(self, store: SessionStore, node_id: str, retention_s: float,
                 clock: Callable[[], float] = time.time, *,
                 context_max_bytes: int = 8 << 20, keep_live_s: float = 0.0) -> None:
        self.store = store
        self.node_id = node_id
        self.retention_s = retention_s
        self.clock = clock
        self.context_max_bytes = context_max_bytes
        """Cap on one session's saved model context (`duplex.store.context`)."""
        self.live = LiveStates(keep_live_s)
        """Engine states of dropped connections, kept for a resume on this node."""

    def new_lease(self, session_id: str) -> tuple[Lease, str]:
        """A lease for a new session and its resume token (only the token's hash is kept)."""
        token = new_secret("rt_")
        return Lease(session_id, 1, hash_secret(token), self.clock()), token

    async def save(self, lease: Lease, conversation: list[dict[str, Any]],
                   config: dict[str, Any], context: StoredContext | None = None) -> bool:
        """Write the session under the lease's epoch; raises Fenced or StoreUnavailable.
        `context` None leaves the stored model context as it is; True when the registry lacks
        context the save took as held (`SessionStore.save`)."""
        return await self.store.save(SessionRecord(
            id=lease.session_id, owner=self.node_id, epoch=lease.epoch,
            secret_hash=lease.secret_hash, deadline=self.clock() + self.retention_s,
            created_at=lease.created_at, conversation=conversation, config=config,
            context=context,
        ))

    async def forget(self, lease: Lease) -> None:
        await self.store.delete(lease.session_id)

    async def resumable(self, session_id: str, token: str) -> bool:
        """Whether `token` would resume `session_id` now (nothing is claimed); False when the
        registry cannot be reached."""
        try:
            record = await self.store.load(session_id)
        except StoreUnavailable:
            return False
        return (record is not None and not record.expired and record.deadline > self.clock()
                and secret_matches(token, record.secret_hash))

    async def resume(self, session_id: str, token: str) -> tuple[Lease, SessionRecord]:
        try:
            record = await self.store.load(session_id)
            if record is None:
                raise ResumeError("session_not_found", f"Session '{session_id}' does not exist.")
            if not secret_matches(token, record.secret_hash):
                raise ResumeError("resume_token_invalid",
                                  f"The resume_token does not match session '{session_id}'.")
            if record.expired or record.deadline <= self.clock():
                raise ResumeError("session_expired",
                                  f"Session '{session_id}' expired; it was kept "
                                  f"{self.retention_s:g} s after its last activity.")
            claimed = await self.store.claim(session_id, self.node_id, record.epoch,
                                             self.clock() + self.retention_s)
        except SessionNotFound:
            raise ResumeError("session_expired", f"Session '{session_id}' expired.") from None
        except Fenced:
            raise ResumeError("session_taken_over",
                              f"Session '{session_id}' was resumed by another connection at the "
                              "same time.") from None
        except StoreUnavailable:
            raise ResumeError("session_store_unavailable",
                              "The session registry cannot be reached; try again.") from None
        lease = Lease(session_id, claimed.epoch, claimed.secret_hash, claimed.created_at)
        return lease, claimed

    async def issue_key(self, key_id: str, session_id: str, session: dict[str, Any],
                        ttl_s: float) -> tuple[str, float]:
        value = new_secret("ek_")
        expires_at = self.clock() + ttl_s
        await self.store.put_key(hash_secret(value),
                                 EphemeralKey(key_id, expires_at, session_id, session))
        return value, expires_at

    async def take_key(self, value: str) -> EphemeralKey | None:
        """The ephemeral key `value`, used up; None when unknown, used or expired."""
        key = await self.store.take_key(hash_secret(value))
        if key is None or key.expires_at <= self.clock():
            return None
        return key
