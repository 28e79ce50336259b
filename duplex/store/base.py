"""The session registry's records and the interface both backends implement.

A record holds what a session needs to continue on another node: who owns it, the fencing
epoch, the hash of its resume secret, the conversation as the listener heard it, and the
deadline past which it is expired. Past the deadline only a tombstone (the secret's hash) is
kept for `tombstone_s`, so a late resume is told `session_expired` rather than `not found`;
after that nothing is left.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol


def hash_secret(secret: str) -> str:
    # The secrets are 256-bit random, so a plain SHA-256 cannot be brute-forced; a slow KDF
    # would only cost latency on every resume.
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, secret_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), secret_hash)


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


@dataclass
class StoredContext:
    """The model's context as the registry keeps it (`duplex.store.context`): a small index,
    rewritten by every save that changes it, naming parts that never change once written (a
    block of audio, a turn), each written once under its own name and deleted once the index
    no longer names it. Parts are only written with an index, by a save that passed the
    fencing check, so a node that lost the session can write none."""

    index: dict[str, Any] = field(default_factory=dict)
    parts: dict[str, str] = field(default_factory=dict)
    """Name -> content. In a save: only the parts the registry does not hold yet; loaded: all
    the index names."""
    names: tuple[str, ...] = ()
    """Every part the index names; a save deletes the others."""


@dataclass
class SessionRecord:
    id: str
    owner: str
    epoch: int
    """Fencing token: bumped by every claim; a write carrying an older epoch is refused."""
    secret_hash: str
    deadline: float
    """Unix time past which the session is expired (pushed forward by every save)."""
    created_at: float
    conversation: list[dict[str, Any]] = field(default_factory=list)
    """Items as heard: user items, and assistant transcripts cut at the playback watermark."""
    config: dict[str, Any] = field(default_factory=dict)
    context: StoredContext | None = field(default_factory=StoredContext)
    """The model's context as heard, for a rebuild on another node; None in a save: the
    stored one is still current."""
    expired: bool = False
    """A tombstone: the session is past its deadline and its conversation is gone."""


@dataclass
class EphemeralKey:
    key_id: str
    """The API key it was issued under; limits count against that key."""
    expires_at: float
    session_id: str
    """The id of the one session the key opens."""
    session: dict[str, Any] = field(default_factory=dict)


class StoreError(Exception):
    pass


class StoreUnavailable(StoreError):
    """The backend cannot be reached; live sessions go on and persist again later."""


class SessionNotFound(StoreError):
    pass


class Fenced(StoreError):
    """Another node holds the session under a newer epoch."""

    def __init__(self, session_id: str, epoch: int, owner: str) -> None:
        super().__init__(f"session {session_id} is owned by {owner} at epoch {epoch}")
        self.epoch = epoch
        self.owner = owner


class SessionStore(Protocol):
    async def save(self, record: SessionRecord) -> bool:
        """Create or update `record` unless a newer epoch (or another owner at the same epoch)
        holds it (raises Fenced). A missing record is written again: that is how an owner
        reconciles a registry that lost its data. True when the registry lacks context the
        save took as held (the record was missing and the context left out, or a part the
        index names was neither sent nor held): the stored context is left as it was, and the
        caller must send the whole context again."""

    async def load(self, session_id: str) -> SessionRecord | None: ...

    async def claim(self, session_id: str, node: str, expected_epoch: int,
                    deadline: float) -> SessionRecord:
        """Take ownership: epoch becomes expected_epoch + 1 atomically. Raises Fenced when the
        stored epoch is not `expected_epoch` (someone claimed first), SessionNotFound when the
        session is gone or expired."""

    async def delete(self, session_id: str) -> None: ...

    async def put_key(self, secret_hash: str, key: EphemeralKey) -> None: ...

    async def take_key(self, secret_hash: str) -> EphemeralKey | None:
        """The key, removed in the same step: an ephemeral key opens one session."""

    async def close(self) -> None: ...
