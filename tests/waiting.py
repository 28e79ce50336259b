"""Waiting on a condition, never on the clock alone: poll it until it holds, and fail at a
deadline naming what never happened. The one place tests pause between looks."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.02


def until(holds: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    """`holds()`'s first true value, polled from a thread that may block."""
    deadline = time.monotonic() + timeout_s
    while not (value := holds()):
        assert time.monotonic() < deadline, f"after {timeout_s:g} s, still not: {what}"
        time.sleep(POLL_S)
    return value


async def eventually(holds: Callable[[], Any], what: str | None, timeout_s: float = 10.0) -> Any:
    """`holds()`'s first true value (it may be a coroutine function). With `what` None the
    deadline is no failure: the last value comes back, for waits that may end either way."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = holds()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            assert what is None, f"after {timeout_s:g} s, still not: {what}"
            return value
        await asyncio.sleep(POLL_S)
