"""The input encoders' feature cache: an input seen again (the same image sent twice, a still
camera view) is not encoded again.

Keyed by (what shapes the embedding, a hash of the input's content). The first part is the
encoder's own key: its checkpoint (`models.fingerprint`), dtype, device and every
preprocessing setting (resize rule, patching, normalisation), so a change of model or of
preprocessing can never find an embedding made under the other. The content is hashed as the
encoder receives it, decoded pixels, so whatever decoded them is part of the content. Bounded
in bytes, least recently used first out. Entries are never written after they are made: a
session may hold one (by reference) while the cache drops it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from models.caches import ByteLRU, CacheStats

FeatureKey = tuple[str, bytes]
"""(the encoder's settings key, content digest)."""


def content_digest(array: np.ndarray) -> bytes:
    """A digest of an array's shape, dtype and values."""
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{array.shape}:{array.dtype}".encode())
    h.update(np.ascontiguousarray(array).data)
    return h.digest()


class FeatureCache:
    def __init__(self, budget_bytes: int) -> None:
        self._lru: ByteLRU[Any] = ByteLRU(budget_bytes)

    def get(self, key: FeatureKey) -> Any | None:
        return self._lru.get(key)

    def put(self, key: FeatureKey, features: Any, nbytes: int) -> bool:
        return self._lru.put(key, features, nbytes)

    def stats(self) -> CacheStats:
        return self._lru.stats()
