"""Session registry and resume: in-memory (embedded default) and Redis (scale-out)."""

from duplex.store.base import (
    EphemeralKey,
    Fenced,
    SessionNotFound,
    SessionRecord,
    SessionStore,
    StoredContext,
    StoreError,
    StoreUnavailable,
    hash_secret,
    secret_matches,
)
from duplex.store.memory import MemoryStore
from duplex.store.registry import Lease, ResumeError, SessionRegistry

__all__ = [
    "EphemeralKey",
    "Fenced",
    "Lease",
    "MemoryStore",
    "ResumeError",
    "SessionNotFound",
    "SessionRecord",
    "SessionRegistry",
    "SessionStore",
    "StoreError",
    "StoredContext",
    "StoreUnavailable",
    "hash_secret",
    "open_store",
    "secret_matches",
]


def open_store(backend: str, redis_url: str, tombstone_s: float) -> SessionStore:
    if backend == "redis":
        from duplex.store.redis_store import RedisStore

        return RedisStore(redis_url, tombstone_s=tombstone_s)
    return MemoryStore(tombstone_s=tombstone_s)
