"""Keeps one live session saved in the registry: soon after its conversation changes, and on
every heartbeat otherwise. A save refused by fencing means another connection owns the session
now; an unreachable registry never stops the session. The model's context goes as its index
and the parts the registry does not hold yet; when the registry says it lacks some (it lost
the record, or restarted), the next save sends the whole context again. A resumed session
starts out holding what the record it claimed names, so its first save sends only what
changed since.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from duplex.store.base import Fenced, StoredContext, StoreUnavailable
from duplex.store.registry import Lease, SessionRegistry

log = logging.getLogger("duplex.store")
Snapshot = Callable[[], tuple[list[dict[str, Any]], dict[str, Any], StoredContext]]
"""The conversation as heard, the settings, and the model's context record."""


class SessionKeeper:
    def __init__(self, registry: SessionRegistry, lease: Lease, snapshot: Snapshot,
                 on_fenced: Callable[[], None], heartbeat_s: float) -> None:
        self.registry = registry
        self.lease = lease
        self.snapshot = snapshot
        self.on_fenced = on_fenced
        self.heartbeat_s = heartbeat_s
        self.fenced = False
        self.stopping = False
        self.reachable = True
        self._dirty = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._held: tuple[dict[str, Any] | None, frozenset[str]] | None = None
        """The context index the registry holds from this keeper's last save, and the parts
        it names; an index None: send the index, the parts are held; None: send the whole
        context."""

    async def start(self) -> None:
        # Saved before the client learns its resume token, so a resume can always find it.
        await self.save()
        self._task = asyncio.create_task(self._run())

    def touch(self) -> None:
        self._dirty.set()

    async def _run(self) -> None:
        while not (self.fenced or self.stopping):
            # Not wait_for: on 3.11 it swallows a cancel that lands just as the wait ends (a
            # touch right before stop), and this loop, and the session's close, never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.heartbeat_s):
                    await self._dirty.wait()
            self._dirty.clear()
            await self.save()

    async def save(self) -> None:
        async with self._lock:
            if self.fenced:
                return
            conversation, config, context = self.snapshot()
            held = self._held
            delta = None
            if held is None or context.index != held[0]:
                known = held[1] if held is not None else frozenset()
                delta = StoredContext(context.index, {n: text for n, text in context.parts.items()
                                                      if n not in known}, context.names)
            try:
                resend = await self.registry.save(self.lease, conversation, config, delta)
            except Fenced as exc:
                self.fenced = True
                log.warning("session %s taken over: %s", self.lease.session_id, exc)
                self.on_fenced()
            except StoreUnavailable as exc:
                if self.reachable:
                    log.warning("session registry unreachable; session %s goes on unsaved: %s",
                                self.lease.session_id, exc)
                self.reachable = False
            else:
                self._held = (context.index, frozenset(context.names))
                if resend:
                    self._held = None
                    self.touch()
                if not self.reachable:
                    log.info("session registry reachable again; session %s saved",
                             self.lease.session_id)
                self.reachable = True

    async def switch(self, lease: Lease, held: StoredContext) -> None:
        """Keep `lease` (a resumed session) instead; the fresh session it replaces is dropped.
        `held` is the context the claim found: the registry holds its parts under the lease's
        session, and the snapshot, rebuilt from it before the next save can run, names them
        as it does."""
        async with self._lock:
            old, self.lease = self.lease, lease
            # Its index is sent all the same: the connection that lost the session could still
            # save between the load and the claim, and the first save puts back the one the
            # rebuilt context goes on from.
            self._held = (None, frozenset(held.names))
            with contextlib.suppress(StoreUnavailable):
                await self.registry.forget(old)
        self.touch()

    async def stop(self) -> None:
        """Stop the heartbeat and save once more: the transcript as heard at disconnect."""
        # Besides the cancel: a cancel landing inside a registry call did not always end the
        # loop (seen with Redis, about one close in three once records carried the context).
        self.stopping = True
        self._dirty.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.save(), 2 * self.heartbeat_s + 1)
