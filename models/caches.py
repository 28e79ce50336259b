"""What the adapters' shared caches have in common: a byte budget, least-recently-used
eviction, entries pinned while in use, and the counters they report.

Two caches use it (a module each): the Thinker's prefix KV (`models.prefix_cache`) and the
input encoders' features (`models.feature_cache`). Neither ever holds live-session state: a
session reads an entry that is never written again (a prefix's KV blocks it copies before
writing into them).
No torch here: the counters travel to the engine's callers, which must not import it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

PREFIX, FEATURE = "prefix", "feature"
"""The caches' names, as `/metrics` (`duplex_{name}_cache_*`) and the bench JSON spell them."""


@dataclass(frozen=True)
class CacheBudgets:
    """Bytes each cache may hold; 0 turns it off (every lookup a miss, nothing kept)."""

    prefix_bytes: int = 1 << 30
    feature_bytes: int = 256 << 20


@dataclass(frozen=True)
class CacheStats:
    """Counters since the cache was made, and what it holds now."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    refused: int = 0
    """Entries not kept: larger than the budget, or than what unpinned entries leave of it."""
    bytes: int = 0
    entries: int = 0
    budget_bytes: int = 0


class ByteLRU(Generic[V]):
    """Values by key, their bytes within `budget`; the least recently used unpinned ones go
    first when a new one needs room. A pinned entry (refcount > 0) is never evicted."""

    def __init__(self, budget: int, on_evict: Callable[[V], None] | None = None) -> None:
        """`on_evict(value)` hears each entry that leaves (to give back what it holds)."""
        if budget < 0:
            raise ValueError(f"a cache budget is a byte count >= 0, not {budget}")
        self.budget = budget
        self._on_evict = on_evict
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._refs: dict[Hashable, int] = {}
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.refused = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable, pin: bool = False) -> V | None:
        """The value (counted as a hit, made most recent, pinned if asked) or None (a miss)."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        if pin:
            self.pin(key)
        return entry[0]

    def put(self, key: Hashable, value: V, nbytes: int, pin: bool = False) -> bool:
        """Keep `value` (pinned if asked), evicting least recently used unpinned entries to make
        room; False, evicting nothing, when it cannot fit. A key already held stays as it is."""
        if key in self._entries:
            if pin:
                self.pin(key)
            return True
        evictable = sum(n for k, (_, n) in self._entries.items() if k not in self._refs)
        if self.bytes - evictable + nbytes > self.budget:
            self.refused += 1
            return False
        for old in [k for k in self._entries if k not in self._refs]:
            if self.bytes + nbytes <= self.budget:
                break
            self.evict(old)
        self._entries[key] = (value, nbytes)
        self.bytes += nbytes
        if pin:
            self.pin(key)
        return True

    def pin(self, key: Hashable) -> None:
        if key not in self._entries:
            raise KeyError(f"no cache entry to pin: {key!r}")
        self._refs[key] = self._refs.get(key, 0) + 1

    def unpin(self, key: Hashable) -> None:
        refs = self._refs.get(key, 0)
        if refs <= 0:
            raise KeyError(f"cache entry not pinned: {key!r}")
        if refs == 1:
            del self._refs[key]
        else:
            self._refs[key] = refs - 1

    def refs(self, key: Hashable) -> int:
        return self._refs.get(key, 0)

    def unpinned(self) -> Iterator[tuple[Hashable, V]]:
        """Entries nobody pins, least recently used first (a snapshot: evicting is safe)."""
        return iter([(k, v) for k, (v, _) in self._entries.items() if k not in self._refs])

    def evict(self, key: Hashable) -> None:
        if key in self._refs:
            raise KeyError(f"cache entry in use: {key!r}")
        value, nbytes = self._entries.pop(key)
        self.bytes -= nbytes
        self.evictions += 1
        if self._on_evict is not None:
            self._on_evict(value)

    def stats(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, self.evictions, self.refused, self.bytes,
                          len(self._entries), self.budget)
