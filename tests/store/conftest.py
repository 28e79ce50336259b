"""Each store test runs on both stores: in memory on a fake clock, and on a real redis-server
(which expires keys on its own clock, the real one)."""

import time

import pytest

from duplex.store import MemoryStore
from duplex.store.redis_store import RedisStore


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        s = MemoryStore(tombstone_s=0.4, clock=FakeClock())
    else:
        s = RedisStore(request.getfixturevalue("redis_server").url, tombstone_s=0.4)
    yield s
    await s.close()
