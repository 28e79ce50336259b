"""Per-key and node-wide limits: concurrent sessions and client message rates (token buckets).

Counted on this node: with N replicas behind a balancer, a key's ceiling is N times these.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from duplex.config import LimitsSettings


class TokenBucket:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.at = clock()

    def wait(self) -> float:
        """Seconds until a token is free (0: one is free now)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def take(self) -> None:
        self.tokens -= 1


class Quota:
    """One session's share: the buckets its messages draw from, and how long it may last."""

    def __init__(self, buckets: list[TokenBucket], max_session_s: float) -> None:
        self.buckets = buckets
        self.max_session_s = max_session_s

    def take(self) -> float:
        """0 when the message may go through (and it is counted), else seconds to wait."""
        wait = max((b.wait() for b in self.buckets), default=0.0)
        if wait == 0:
            for b in self.buckets:
                b.take()
        return wait


class Admission:
    def __init__(self, config: LimitsSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.total = 0
        self.per_key: dict[str, int] = {}
        self._global = (TokenBucket(config.messages_per_s, config.message_burst, clock)
                        if config.messages_per_s else None)
        self._key_buckets: dict[str, TokenBucket] = {}

    def enter(self, key_id: str) -> str | None:
        """Count a new session in; returns the name of the limit it would break instead."""
        c = self.config
        if c.sessions and self.total >= c.sessions:
            return "limits.sessions"
        if c.sessions_per_key and self.per_key.get(key_id, 0) >= c.sessions_per_key:
            return "limits.sessions_per_key"
        self.total += 1
        self.per_key[key_id] = self.per_key.get(key_id, 0) + 1
        return None

    def leave(self, key_id: str) -> None:
        self.total -= 1
        left = self.per_key[key_id] - 1
        if left:
            self.per_key[key_id] = left
        else:
            del self.per_key[key_id]

    def quota(self, key_id: str) -> Quota:
        c = self.config
        buckets = [self._global] if self._global is not None else []
        if c.messages_per_s_per_key:
            bucket = self._key_buckets.get(key_id)
            if bucket is None:
                bucket = TokenBucket(c.messages_per_s_per_key, c.message_burst, self.clock)
                self._key_buckets[key_id] = bucket
            buckets.append(bucket)
        return Quota(buckets, c.max_session_s)
