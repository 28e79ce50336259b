"""The byte-bounded LRU both caches keep, against a plain model of it, over random operations."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from models.caches import ByteLRU

BUDGET = 100
KEYS = st.sampled_from("abcdefgh")


class ByteLRUMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: ByteLRU[str] = ByteLRU(BUDGET)
        self.order: list[str] = []
        """The model: keys held, least recently used first."""
        self.sizes: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.evicted = 0

    def _touch(self, key: str) -> None:
        self.order.remove(key)
        self.order.append(key)

    @rule(key=KEYS, size=st.integers(0, 60), pin=st.booleans())
    def put(self, key: str, size: int, pin: bool) -> None:
        kept = self.cache.put(key, f"value of {key}", size, pin=pin)
        if key in self.sizes:
            assert kept
        else:
            unpinned = sum(self.sizes[k] for k in self.order if not self.pins.get(k))
            fits = sum(self.sizes.values()) - unpinned + size <= BUDGET
            assert kept == fits
            if not fits:
                return
            for old in [k for k in self.order if not self.pins.get(k)]:
                if sum(self.sizes.values()) + size <= BUDGET:
                    break
                self.order.remove(old)
                del self.sizes[old]
                self.evicted += 1
            self.order.append(key)
            self.sizes[key] = size
        if pin:
            self.pins[key] = self.pins.get(key, 0) + 1

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        value = self.cache.get(key)
        assert (value is not None) == (key in self.sizes)
        if value is not None:
            assert value == f"value of {key}"
            self._touch(key)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.cache.unpin(key)
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @invariant()
    def agrees_with_the_model(self) -> None:
        stats = self.cache.stats()
        assert stats.bytes == sum(self.sizes.values()) <= BUDGET
        assert stats.entries == len(self.sizes) and stats.evictions == self.evicted
        assert all(key in self.cache for key in self.pins)
        assert all(self.cache.refs(key) == n for key, n in self.pins.items())


TestByteLRU = ByteLRUMachine.TestCase
TestByteLRU.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
