"""Sessions whose connection dropped while their node lives on. Their engine state (the model's
context, KV and all) is kept for `store.keep_live_s`, so a resume that lands on this node takes
it over as it is instead of rebuilding it from the registry; past that it is released.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from duplex.media.fir import InputResamplers


@dataclass
class Parked:
    engine_id: str
    """The engine session that holds the state."""
    lease_epoch: int
    """The registry epoch it was kept under: a claim from exactly that epoch finds it current."""
    reply_epoch: int
    """The engine's reply epoch, which the session that takes it over continues from."""
    release: Callable[[], None]
    resamplers: InputResamplers | None = None
    """Where the dropped connection's input resamplers stood: the engine holds all they gave."""
    _expiry: asyncio.TimerHandle | None = field(default=None, repr=False)


class LiveStates:
    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._parked: dict[str, Parked] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, session_id: str, parked: Parked) -> None:
        """Keep `parked` for `keep_s` (it replaces any older one of the session)."""
        self._drop(session_id)
        parked._expiry = asyncio.get_running_loop().call_later(self.keep_s, self._drop,
                                                               session_id)
        self._parked[session_id] = parked

    def take(self, session_id: str, claimed_epoch: int) -> Parked | None:
        """The state kept for `session_id` if nobody else resumed it since (the claim that
        just succeeded came straight from the kept epoch); a stale one is released."""
        parked = self._parked.pop(session_id, None)
        if parked is None:
            return None
        if parked._expiry is not None:
            parked._expiry.cancel()
        if parked.lease_epoch + 1 != claimed_epoch:
            parked.release()
            return None
        return parked

    def _drop(self, session_id: str) -> None:
        parked = self._parked.pop(session_id, None)
        if parked is not None:
            if parked._expiry is not None:
                parked._expiry.cancel()
            parked.release()

    def close_all(self) -> None:
        for session_id in list(self._parked):
            self._drop(session_id)
