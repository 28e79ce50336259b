"""The asyncio side of one session, whatever its transport.

A session's protocol core is pure; this loop feeds it, in order, everything that happens to
the session (frames from the peer, engine results, VAD probabilities, clock ticks) and carries
out the effects it returns. Engine and VAD threads post into the same inbox, so the core is
only ever touched from the event loop. Transports subclass it for what is theirs alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from duplex.engine import AudioOut, Engine, ResponseFinished, SessionFailed
from duplex.transport.effects import (
    CloseConnection,
    EngineCancel,
    EngineCommit,
    EnginePush,
    Send,
    VadFeed,
)
from duplex.vad import VadService, VadStream

TICK_S = 0.02
PEER_GONE = (WebSocketDisconnect, RuntimeError, OSError)
"""What writing to a connection that has ended raises: Starlette's WebSocketDisconnect (and its
WebSocketDisconnected, a RuntimeError, once it knows); the server's RuntimeError when it closed
the connection itself (over a frame it could not take); its ClientDisconnected and socket
errors (OSError) when the peer left."""


class SessionLoop:
    rate: int
    """Samples per second of the protocol's clock."""

    def __init__(self, engine: Engine, vad: VadService, send_text, session_id: str,
                 protocol) -> None:
        self.engine = engine
        self.vad = vad
        self.send_text = send_text
        self.session_id = session_id
        self.protocol = protocol
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.vad_stream = VadStream()
        self.t0 = time.monotonic_ns()
        self.close_code: int | None = None
        self.close_reason = ""

    def now_sample(self) -> int:
        return (time.monotonic_ns() - self.t0) * self.rate // 1_000_000_000

    def _post(self, item) -> None:
        # Engine and VAD threads may still answer after the session's loop has ended.
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)
            except RuntimeError:
                pass

    def open(self) -> None:
        """Admit the session into the engine; raises AdmissionRefused when over a limit."""
        self.engine.open(self.session_id, lambda event: self._post(("engine", event)))

    def feed_text(self, text: str) -> None:
        self.inbox.put_nowait(("text", text))

    def feed_bytes(self, data: bytes) -> None:
        self.inbox.put_nowait(("bytes", data))

    def carrier_gone(self) -> None:
        self.inbox.put_nowait(("gone",))

    async def shutdown(self, reason: str) -> None:
        self.inbox.put_nowait(("close", 1001, reason))

    async def run(self) -> None:
        """Serve until the carrier is gone or the protocol closes; then release everything."""
        ticker = asyncio.create_task(self._tick())
        try:
            if not await self.started():
                await self._loop()
        finally:
            ticker.cancel()
            try:
                self.engine.close(self.session_id)
            finally:
                await self.ended()

    async def started(self) -> bool:
        """Before the first frame; True ends the session at once."""
        return False

    async def ended(self) -> None:
        """After the engine has let go of the session."""

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.inbox.put_nowait(("tick",))

    async def _loop(self) -> None:
        while True:
            item = await self.inbox.get()
            if item[0] == "gone":
                return
            if item[0] == "close":
                self.close_code, self.close_reason = item[1], item[2]
                return
            effects = self.dispatch(item)
            effects += self.protocol.release_output(self.now_sample())
            if await self.execute(effects):
                return

    def dispatch(self, item: tuple) -> list:
        """Hand one inbox item to the protocol; returns its effects."""
        p = self.protocol
        kind = item[0]
        if kind == "text":
            return p.receive_text(item[1])
        if kind == "bytes":
            return p.receive_bytes(item[1])
        if kind == "vad":
            return p.on_vad(item[1])
        if kind == "engine":
            event = item[1]
            if isinstance(event, AudioOut):
                return p.on_engine_audio(event.epoch, event.pcm, event.text)
            if isinstance(event, ResponseFinished):
                return p.on_engine_finished(event.epoch)
            if isinstance(event, SessionFailed):
                return p.on_engine_failed(event.message)
        return []

    async def execute(self, effects) -> bool:
        """Carry out effects in order; True when the session must end."""
        sid = self.session_id
        for effect in effects:
            if isinstance(effect, Send):
                if not await self._send(effect.event):
                    return True
            elif isinstance(effect, EnginePush):
                self.engine.push_audio(sid, effect.pcm)
            elif isinstance(effect, VadFeed):
                self.vad.submit(self.vad_stream, effect.pcm, lambda probs: self._post(("vad", probs)))
            elif isinstance(effect, EngineCommit):
                self.engine.commit(sid, effect.epoch)
            elif isinstance(effect, EngineCancel):
                self.engine.cancel(sid, effect.epoch)
            elif isinstance(effect, CloseConnection):
                self.close_code, self.close_reason = effect.code, effect.reason
                return True
            elif await self.carry_out(effect):
                return True
        return False

    async def _send(self, event: dict) -> bool:
        """False when the peer has left: the session ends quietly, nobody is there to hear why."""
        text = json.dumps(event)
        try:
            await self.send_text(text)
        except PEER_GONE:
            return False
        self.sent(event)
        return True

    def sent(self, event: dict) -> None:
        """An event just went to the peer."""

    async def carry_out(self, effect) -> bool:
        """An effect only this transport knows; True ends the session."""
        raise TypeError(f"{type(self).__name__} cannot carry out {type(effect).__name__}")


async def close_quietly(ws: WebSocket, code: int, reason: str = "") -> None:
    """Close `ws` unless it is closed already; a peer that left meanwhile is no error."""
    if ws.application_state is WebSocketState.CONNECTED:
        with contextlib.suppress(*PEER_GONE):
            await ws.close(code, reason)


async def serve_websocket(ws: WebSocket, session: SessionLoop, hub) -> None:
    """Run an admitted session over an accepted WebSocket until either side ends it (or the
    connection drops); then release it: engine, session state, socket, hub entry, in that
    order, whatever went wrong before."""
    hub.add(session.session_id, session.shutdown)

    async def read() -> None:
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") is not None:
                    session.feed_text(message["text"])
                elif message.get("bytes") is not None:
                    session.feed_bytes(message["bytes"])
        except PEER_GONE:
            pass
        finally:
            session.carrier_gone()

    reader = asyncio.create_task(read())
    try:
        await session.run()
    except Exception:
        # Our fault, not the peer's: tell it so, and let the error rise to be logged.
        session.close_code, session.close_reason = 1011, "internal error"
        raise
    finally:
        reader.cancel()
        try:
            await close_quietly(ws, session.close_code or 1000, session.close_reason)
        finally:
            hub.discard(session.session_id)
