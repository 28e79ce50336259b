"""Integer accounting of one input track: every unit received is consumed, buffered or dropped."""

from dataclasses import dataclass, field

from duplex.session.errors import InvalidCommand


def require_count(name: str, value: object, *, positive: bool = False) -> int:
    """Sample counts are plain ints (bool excluded); floats of seconds never enter the clock."""
    if type(value) is not int:
        raise InvalidCommand(f"{name} must be an int sample count, got {type(value).__name__}")
    if value < 0 or (positive and value == 0):
        raise InvalidCommand(f"{name} must be {'> 0' if positive else '>= 0'}, got {value}")
    return value


@dataclass
class TrackCounters:
    received: int = 0
    consumed: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def buffered(self) -> int:
        return self.received - self.consumed - self.dropped_total

    def check_take(self, n: int) -> None:
        if n > self.buffered:
            raise InvalidCommand(f"cannot take {n} from a buffer holding {self.buffered}")

    def receive(self, n: int) -> None:
        self.received += n

    def consume(self, n: int) -> None:
        self.check_take(n)
        self.consumed += n

    def drop(self, n: int, reason: str) -> None:
        self.check_take(n)
        if n:
            self.dropped[reason] = self.dropped.get(reason, 0) + n

    def snapshot(self) -> dict[str, object]:
        return {
            "received": self.received,
            "consumed": self.consumed,
            "buffered": self.buffered,
            "dropped": dict(self.dropped),
        }
