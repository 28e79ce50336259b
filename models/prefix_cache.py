"""The Thinker's prefix cache: the KV of a context's head (its system turn: instructions and
tools as the chat template renders them), computed once and shared by reference with each new
session whose context starts with the same tokens.

An entry is a reference to the paged KV blocks (`models.paged_kv`) that hold the head's
positions: the first session to compute the head keeps a reference to its blocks, later ones
put the same blocks at the start of their block tables. A session writing past the head into
its last, partly filled block copies that block first (copy on write), so no session writes a
cached block (the positions past the head in that block, whoever wrote them, are never read
through the cache: a session's attention stops at its own length), and the cache's bytes are
the blocks it holds, counted once however many sessions share them.

Keyed by (model version and pool, the head's token ids): the KV of positions 0..n-1 depends on
nothing else (causal attention, fixed positions), and blocks are only meaningful in their own
pool. A session pins the entry its context started from until it closes, so a prefix in use by
live sessions stays for the next one; only unpinned entries are evicted, least recently used
first, to stay within the byte budget or to give their blocks back to a pool that runs short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.caches import ByteLRU, CacheStats

PrefixKey = tuple[str, tuple[int, ...]]
"""(model version and pool, the head's token ids)."""


@dataclass(frozen=True)
class PrefixKV:
    """The blocks of `pool` (a `PagedKV`) holding positions 0..length-1, one reference each."""

    pool: Any
    blocks: tuple[int, ...]
    length: int

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self._lru: ByteLRU[PrefixKV] = ByteLRU(budget_bytes, on_evict=_drop)

    @property
    def enabled(self) -> bool:
        return self._lru.budget > 0

    def take(self, key: PrefixKey) -> PrefixKV | None:
        """The head's KV, pinned for the caller until `release`; None (a miss) if not held."""
        return self._lru.get(key, pin=True)

    def keep(self, key: PrefixKey, kv: PrefixKV) -> bool:
        """Hold `kv` (its references become the cache's), pinned for the caller until
        `release`; False when it does not fit, and the references are given back."""
        held = key in self._lru
        kept = self._lru.put(key, kv, kv.nbytes, pin=True)
        if held or not kept:
            _drop(kv)
        return kept

    def release(self, key: PrefixKey) -> None:
        self._lru.unpin(key)

    def refs(self, key: PrefixKey) -> int:
        return self._lru.refs(key)

    def __contains__(self, key: PrefixKey) -> bool:
        return key in self._lru

    def stats(self) -> CacheStats:
        return self._lru.stats()

    # A pool's `Spare`: entries no session uses give their blocks back when it runs short.

    def reclaimable(self, pool: Any) -> int:
        return sum(len(kv.blocks) for _, kv in self._lru.unpinned() if kv.pool is pool)

    def reclaim(self, pool: Any, blocks: int) -> None:
        """Evict unpinned entries of `pool`, least recently used first, until `blocks` blocks
        came back or none are left."""
        freed = 0
        for key, kv in self._lru.unpinned():
            if freed >= blocks:
                return
            if kv.pool is pool:
                self._lru.evict(key)
                freed += len(kv.blocks)


def _drop(kv: PrefixKV) -> None:
    kv.pool.drop(kv.blocks)
