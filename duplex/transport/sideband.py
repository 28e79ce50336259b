"""Sidebands: a server's WebSocket on a live call (`/v1/realtime?call_id=ID`), as OpenAI's
server-side controls.

A call stays one session. Every server event it sends goes to its carrier (the WebRTC data
channel) and to each sideband; each sideband's client events go into the same inbox as the
carrier's, in arrival order, so both see one conversation. A sideband draws on the call's seat
and message quota, not on its own. Closing a sideband leaves the call; the call's end closes its
sidebands (1000). A call id that names no live call of the same key is refused at the handshake
(404 call_id_not_found), whether the call never was, has ended, or is another key's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from typing import Protocol

from starlette.websockets import WebSocket

from duplex.access.auth import choose_subprotocol
from duplex.access.errors import error_object, error_response, error_type
from duplex.transport.loop import PEER_GONE, close_quietly

MAX_QUEUED = 4096
"""Events one sideband may have waiting to be written; past that it is closed (1008) rather
than hold the call's memory. A call's events are small (its audio goes on the media track)."""


class Sideband:
    """One attached WebSocket. Its events wait in a queue that a task of its own writes out, so
    a slow sideband never holds up the call's loop."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self._waiting: deque[str] = deque()
        self._wake = asyncio.Event()
        self._ended = False
        self.close_code = 1000
        self.close_reason = "call ended"

    def offer(self, text: str) -> bool:
        if len(self._waiting) >= MAX_QUEUED:
            return False
        self._waiting.append(text)
        self._wake.set()
        return True

    def end(self, code: int, reason: str, *, drop: bool = False) -> None:
        """Write what is queued (unless `drop`), then close with `code`."""
        self.close_code, self.close_reason = code, reason
        if drop:
            self._waiting.clear()
        self._ended = True
        self._wake.set()

    async def write(self) -> None:
        """Until the end, or until the peer is gone."""
        while True:
            while self._waiting:
                try:
                    await self.ws.send_text(self._waiting.popleft())
                except PEER_GONE:
                    return
            if self._ended:
                return
            self._wake.clear()
            await self._wake.wait()


class Sidebands:
    """The sidebands attached to one call."""

    def __init__(self) -> None:
        self._attached: set[Sideband] = set()
        self.closed = False

    def __len__(self) -> int:
        return len(self._attached)

    def attach(self, sideband: Sideband, first: str | None) -> bool:
        """`first` (its session.created) goes ahead of every later event; False when the call
        has ended meanwhile."""
        if self.closed:
            return False
        if first is not None:
            sideband.offer(first)
        self._attached.add(sideband)
        return True

    def detach(self, sideband: Sideband) -> None:
        self._attached.discard(sideband)

    def publish(self, text: str) -> None:
        for sideband in list(self._attached):
            if not sideband.offer(text):
                self._attached.discard(sideband)
                sideband.end(1008, "sideband too slow: events were not read", drop=True)

    def close(self) -> None:
        """The call has ended."""
        self.closed = True
        for sideband in self._attached:
            sideband.end(1000, "call ended")
        self._attached.clear()


class LiveCall(Protocol):
    """What a sideband attaches to (a transport's call, registered in the hub by its id)."""

    owner: str
    """The key the call was opened with (its key id); a sideband must show the same."""
    sidebands: Sidebands

    def attached_event(self) -> str | None:
        """session.created as a sideband that attaches now sees it; None before the session
        has sent its own."""

    def feed_text(self, text: str) -> None: ...

    def feed_bytes(self, data: bytes) -> None: ...


def not_found_message(call_id: str) -> str:
    return f"No session found for the provided call_id '{call_id}'."


async def serve_sideband(ws: WebSocket, calls: dict[str, LiveCall]) -> None:
    """Attach `ws` to the call its `call_id` names, and serve it until either ends."""
    call_id = ws.query_params["call_id"]
    principal = ws.scope.get("state", {}).get("principal")
    call = calls.get(call_id)
    if call is None or principal is None or principal.key_id != call.owner:
        await _refuse(ws, 404, "call_id_not_found", not_found_message(call_id), "call_id")
        return
    await ws.accept(subprotocol=choose_subprotocol(ws.scope.get("subprotocols", [])))
    sideband = Sideband(ws)
    if not call.sidebands.attach(sideband, call.attached_event()):
        await close_quietly(ws, 1000, "call ended")
        return
    writer = asyncio.create_task(sideband.write())
    reader = asyncio.create_task(_read(ws, call))
    try:
        await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        call.sidebands.detach(sideband)
        for task in (reader, writer):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await close_quietly(ws, sideband.close_code, sideband.close_reason)


async def _read(ws: WebSocket, call: LiveCall) -> None:
    with contextlib.suppress(*PEER_GONE):
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is not None:
                call.feed_text(message["text"])
            elif message.get("bytes") is not None:
                call.feed_bytes(message["bytes"])


async def _refuse(ws: WebSocket, status: int, code: str, message: str, param: str) -> None:
    """At the handshake, as OpenAI does (an HTTP status and its error body); a server without
    the denial extension accepts, sends the error event and closes (1008)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await ws.send_denial_response(error_response(status, code, message, param))
        return
    await ws.accept()
    error = error_object(error_type(status), code, message, param)
    with contextlib.suppress(*PEER_GONE):
        await ws.send_text(json.dumps({"type": "error", "event_id": "event_sideband",
                                       "error": error}))
    await close_quietly(ws, 1008, code)
