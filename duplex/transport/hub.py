"""The live sessions of this process, so health, metrics and shutdown can see all of them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from duplex.transport.sideband import LiveCall

Closer = Callable[[str], Awaitable[None]]


class SessionHub:
    def __init__(self) -> None:
        self._closers: dict[str, Closer] = {}
        self._empty: asyncio.Event | None = None
        self.calls: dict[str, LiveCall] = {}
        """Live calls by their call id, which sidebands attach to (`?call_id=`); each
        transport adds its calls and takes them out as they end."""

    def __len__(self) -> int:
        return len(self._closers)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._closers

    def add(self, session_id: str, closer: Closer) -> None:
        if session_id in self._closers:
            raise KeyError(f"session {session_id} is already live")
        self._closers[session_id] = closer

    def discard(self, session_id: str) -> None:
        """The session has ended and told its peer so; call this last."""
        self._closers.pop(session_id, None)
        if not self._closers and self._empty is not None:
            self._empty.set()

    async def close_all(self, reason: str, timeout_s: float) -> None:
        """Ask every session to close with `reason` and wait until each has ended, or give up
        on stragglers after timeout_s."""
        closers = list(self._closers.values())
        if not closers:
            return
        self._empty = asyncio.Event()
        for close in closers:
            await close(reason)
        try:
            await asyncio.wait_for(self._empty.wait(), timeout_s)
        except TimeoutError:
            pass
