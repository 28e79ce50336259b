"""The Thinker's prefix cache: the KV of a context's head (its system turn: instructions and
tools as the chat template renders them), computed once and copied into each new session whose
context starts with the same tokens.

Keyed by (model version, the head's token ids): the KV of positions 0..n-1 depends on nothing
else (causal attention, fixed positions). A session pins the entry its context started from
until it closes, so a prefix in use by live sessions stays for the next one; only unpinned
entries are evicted, least recently used first, to stay within the byte budget. The session's
own slot holds a copy: nothing a session computes or evicts ever reaches the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.caches import ByteLRU, CacheStats

PrefixKey = tuple[str, tuple[int, ...]]
"""(model version, the head's token ids)."""


@dataclass(frozen=True)
class PrefixKV:
    """Keys and values of positions 0..length-1, per layer (kv_heads, length, head_dim)."""

    keys: tuple[Any, ...]
    values: tuple[Any, ...]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self._lru: ByteLRU[PrefixKV] = ByteLRU(budget_bytes)

    @property
    def enabled(self) -> bool:
        return self._lru.budget > 0

    def take(self, key: PrefixKey) -> PrefixKV | None:
        """The head's KV, pinned for the caller until `release`; None (a miss) if not held."""
        return self._lru.get(key, pin=True)

    def keep(self, key: PrefixKey, kv: PrefixKV) -> bool:
        """Hold `kv`, pinned for the caller until `release`; False when it does not fit."""
        return self._lru.put(key, kv, kv.nbytes, pin=True)

    def release(self, key: PrefixKey) -> None:
        self._lru.unpin(key)

    def refs(self, key: PrefixKey) -> int:
        return self._lru.refs(key)

    def __contains__(self, key: PrefixKey) -> bool:
        return key in self._lru

    def stats(self) -> CacheStats:
        return self._lru.stats()
