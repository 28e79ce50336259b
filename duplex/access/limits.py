"""Per-key and node-wide limits: concurrent sessions (seats) and client message rates (token
buckets).

Seats are counted by a `Seats`: `LocalSeats` counts this node's sessions (the memory store);
with a Redis store, duplex.store.seats counts every node's, under leases.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from duplex.config import LimitsSettings


def _holder() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Seat:
    """One admitted session's place in the count, given back when it ends. Its id is the
    session's: a resume moves the resuming connection onto it, so a session holds one place
    wherever it is served; `holder` tells the connection that holds it now from one before."""

    id: str
    key_id: str
    holder: str = field(default_factory=_holder)


class OverLimit(Exception):
    """A session refused; `limit` names the setting it would break. The message is the one
    wording of this refusal, on every entry point and node."""

    def __init__(self, limit: str) -> None:
        super().__init__(f"Too many concurrent sessions (limit {limit}).")
        self.limit = limit


def limit_broken(config: LimitsSettings, seats: Iterable[Seat], key_id: str) -> str | None:
    """The limit one more session of `key_id` would break, beside `seats`; None if none."""
    total = per_key = 0
    for seat in seats:
        total += 1
        per_key += seat.key_id == key_id
    if config.sessions and total >= config.sessions:
        return "limits.sessions"
    if config.sessions_per_key and per_key >= config.sessions_per_key:
        return "limits.sessions_per_key"
    return None


def move_held(held: dict[str, Seat], seat: Seat, session_id: str) -> Seat:
    """`held` with `seat` moved onto `session_id`'s: the seat the connection holds now."""
    if held.get(seat.id) == seat:
        del held[seat.id]
    moved = Seat(session_id, seat.key_id, seat.holder)
    held[session_id] = moved
    return moved


class Seats(Protocol):
    held: dict[str, Seat]
    """This node's seats, by id."""

    async def take(self, seat: Seat) -> str | None:
        """Count `seat` in, or name the limit it would break (and count nothing). A seat whose
        id already counts (a resume named at the handshake) is taken over, whatever the count."""

    async def move(self, seat: Seat, session_id: str) -> Seat:
        """`seat` given up for `session_id`'s (the session its connection resumed), which it
        takes over wherever it was held; never counts one more."""

    def give_back(self, seat: Seat) -> None:
        """Unless another connection has taken the seat over since."""

    async def close(self) -> None: ...


class LocalSeats:
    """This node's sessions only: with N nodes behind a balancer, the ceilings are N times."""

    def __init__(self, config: LimitsSettings) -> None:
        self.config = config
        self.held: dict[str, Seat] = {}

    async def take(self, seat: Seat) -> str | None:
        limit = None if seat.id in self.held else limit_broken(self.config, self.held.values(),
                                                               seat.key_id)
        if limit is None:
            self.held[seat.id] = seat
        return limit

    async def move(self, seat: Seat, session_id: str) -> Seat:
        return move_held(self.held, seat, session_id)

    def give_back(self, seat: Seat) -> None:
        if self.held.get(seat.id) == seat:
            del self.held[seat.id]

    async def close(self) -> None:
        pass


class Place:
    """The seat one connection holds, which follows the session it serves."""

    def __init__(self, seats: Seats, seat: Seat) -> None:
        self.seats = seats
        self.seat = seat

    async def move_to(self, session_id: str) -> None:
        """The connection resumed `session_id`: it holds that session's seat instead of its
        own, so the session counts once (not twice until its old lease ends)."""
        if session_id != self.seat.id:
            self.seat = await self.seats.move(self.seat, session_id)


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
    def __init__(self, config: LimitsSettings, clock: Callable[[], float] = time.monotonic,
                 seats: Seats | None = None,
                 on_refused: Callable[[str], None] = lambda limit: None) -> None:
        self.config = config
        self.clock = clock
        self.seats = seats if seats is not None else LocalSeats(config)
        self.on_refused = on_refused
        """Told the limit each refused session would have broken (for the metrics)."""
        self._global = (TokenBucket(config.messages_per_s, config.message_burst, clock)
                        if config.messages_per_s else None)
        self._key_buckets: dict[str, TokenBucket] = {}

    async def enter(self, key_id: str, session_id: str | None = None) -> Place:
        """A place for session `session_id` (a new one's id, or one a resume named and proved
        at the handshake) of `key_id`; raises OverLimit naming the limit instead."""
        seat = Seat(session_id or "seat_" + secrets.token_hex(8), key_id)
        limit = await self.seats.take(seat)
        if limit is not None:
            self.on_refused(limit)
            raise OverLimit(limit)
        return Place(self.seats, seat)

    def leave(self, place: Place) -> None:
        self.seats.give_back(place.seat)

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
