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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from duplex.engine.client import AdmissionRefused, EngineClient
from duplex.engine.lockstep import DuplexDropped, DuplexOut
from duplex.engine.scheduler import (
    AudioOut,
    ResponseFinished,
    SessionFailed,
    TextOut,
    ToolCallOut,
)
from duplex.transport.core import ProtocolCore
from duplex.transport.effects import (
    CloseConnection,
    EngineCancel,
    EngineCommit,
    EngineInstruct,
    EnginePush,
    EnginePushText,
    EngineSetDuplex,
    ScoreTurnEnd,
    Send,
    TurnEnded,
    VadFeed,
)
from duplex.transport.inbox import (
    CarrierGone,
    EngineOutput,
    Inbox,
    Message,
    PeerBytes,
    PeerText,
    Shutdown,
    SpeechProbs,
    Tick,
    TurnScored,
)

if TYPE_CHECKING:
    # The VAD runs torch; protocol cores and this loop import without it.
    from duplex.engine.vad import VadService
    from duplex.observability.metrics import Metrics

TICK_S = 0.02
PEER_GONE = (WebSocketDisconnect, RuntimeError, OSError)
"""What writing to a connection that has ended raises: Starlette's WebSocketDisconnect (and its
WebSocketDisconnected, a RuntimeError, once it knows); the server's RuntimeError when it closed
the connection itself (over a frame it could not take); its ClientDisconnected and socket
errors (OSError) when the peer left."""


class SessionLoop:
    rate: int
    """Samples per second of the protocol's clock."""
    metrics: Metrics | None = None

    def __init__(self, engine: EngineClient, vad: VadService, send_text, session_id: str,
                 protocol: ProtocolCore) -> None:
        self.engine = engine
        self.vad = vad
        self.send_text = send_text
        self.session_id = session_id
        self.engine_id = session_id
        """The engine session this loop drives: its own, or (a Realtime resume on the node
        that kept the session's live state) the one it took over."""
        self.protocol = protocol
        self.inbox = Inbox()
        self.loop = asyncio.get_running_loop()
        self.vad_stream = vad.new_stream()
        self.t0 = time.monotonic_ns()
        self.close_code: int | None = None
        self.close_reason = ""

    def now_sample(self) -> int:
        return (time.monotonic_ns() - self.t0) * self.rate // 1_000_000_000

    def post(self, message: Message) -> None:
        """Put `message` in the inbox from another thread (the engine's, the VAD's)."""
        # Those threads may still answer after the session's loop has ended.
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.inbox.put, message)
            except RuntimeError:
                pass

    def open(self) -> None:
        """Admit the session into the engine; raises AdmissionRefused when over a limit."""
        self.engine.open(self.engine_id, self.deliver)

    def deliver(self, event) -> None:
        """An engine event for this session, from the engine's thread."""
        self.post(EngineOutput(event))

    def feed_text(self, text: str) -> None:
        self.inbox.put(PeerText(text))

    def feed_bytes(self, data: bytes) -> None:
        self.inbox.put(PeerBytes(data))

    def carrier_gone(self) -> None:
        self.inbox.put(CarrierGone())

    async def shutdown(self, reason: str) -> None:
        self.inbox.put(Shutdown(1001, reason))

    async def run(self) -> None:
        """Serve until the carrier is gone or the protocol closes; then release everything."""
        ticker = asyncio.create_task(self._tick())
        try:
            if not await self.started():
                await self._loop()
        finally:
            ticker.cancel()
            try:
                self.release_engine()
            finally:
                await self.ended()

    def release_engine(self) -> None:
        self.engine.close(self.engine_id)

    async def started(self) -> bool:
        """Before the first frame; True ends the session at once."""
        return False

    async def ended(self) -> None:
        """After the engine has let go of the session."""

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.inbox.put(Tick())

    async def _loop(self) -> None:
        while True:
            message = await self.inbox.get()
            if isinstance(message, CarrierGone):
                return
            if isinstance(message, Shutdown):
                self.close_code, self.close_reason = message.code, message.reason
                return
            effects = self.dispatch(message)
            effects += self.protocol.release_output(self.now_sample())
            if await self.execute(effects):
                return

    def dispatch(self, message: Message) -> list:
        """Hand one inbox message to the protocol; returns its effects."""
        handler = _MESSAGES.get(type(message))
        return handler(self, message) if handler is not None else []

    def _engine_output(self, message: EngineOutput) -> list:
        handler = _ENGINE_EVENTS.get(type(message.event))
        return handler(self.protocol, message.event) if handler is not None else []

    async def execute(self, effects) -> bool:
        """Carry out effects in order; True when the session must end."""
        sid = self.engine_id
        for effect in effects:
            if isinstance(effect, Send):
                if not await self._send(effect.event):
                    return True
            elif isinstance(effect, EnginePush):
                self.engine.push_audio(sid, effect.pcm)
            elif isinstance(effect, VadFeed):
                self.vad.submit(self.vad_stream, effect.pcm,
                                lambda r: self.post(SpeechProbs(r.chunks, r.early)),
                                effect.urgent)
            elif isinstance(effect, ScoreTurnEnd):
                self._score_turn(effect)
            elif isinstance(effect, TurnEnded):
                if self.metrics is not None:
                    self.metrics.turns_ended.labels(effect.by).inc()
            elif isinstance(effect, EngineCommit):
                self.engine.commit(sid, effect.epoch, effect.spec)
            elif isinstance(effect, EnginePushText):
                self.engine.push_text(sid, effect.text, effect.role)
            elif isinstance(effect, EngineInstruct):
                self.engine.instruct(sid, effect.instructions, effect.tools)
            elif isinstance(effect, EngineCancel):
                self.engine.cancel(sid, effect.epoch)
            elif isinstance(effect, EngineSetDuplex):
                try:
                    self.engine.set_duplex(sid, effect.on)
                except AdmissionRefused as exc:
                    if await self.execute(self.protocol.duplex_refused(str(exc))):
                        return True
            elif isinstance(effect, CloseConnection):
                self.close_code, self.close_reason = effect.code, effect.reason
                return True
            elif await self.carry_out(effect):
                return True
        return False

    def _score_turn(self, effect: ScoreTurnEnd) -> None:
        """On the worker every session shares (duplex.smart_turn); a server without the model
        answers at once that it cannot judge, and the turn ends by its fallback wait."""
        request = effect.request
        service = self.vad.turn_end
        if service is None:
            self.inbox.put(TurnScored(request, None))
            return
        # Read on the worker: the detector's latest question, an int the loop replaces.
        clock = self.protocol.clock
        service.submit(effect.pcm, lambda p: self.post(TurnScored(request, p)),
                       wanted=lambda: clock.detector.asked == request)

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


_MESSAGES: dict[type, Callable[[SessionLoop, Any], list]] = {
    PeerText: lambda loop, m: loop.protocol.receive_text(m.text),
    PeerBytes: lambda loop, m: loop.protocol.receive_bytes(m.data),
    SpeechProbs: lambda loop, m: loop.protocol.on_vad(m.probs, m.early),
    TurnScored: lambda loop, m: loop.protocol.on_turn_score(m.request, m.complete),
    EngineOutput: lambda loop, m: loop._engine_output(m),
    Tick: lambda loop, m: [],
}
"""Messages every session takes; a transport's own (media, resume) extend it (`messages`)."""

_ENGINE_EVENTS: dict[type, Callable[[Any, Any], list]] = {
    AudioOut: lambda p, e: p.on_engine_audio(e.epoch, e.pcm, e.text),
    TextOut: lambda p, e: p.on_engine_text(e.epoch, e.text),
    ToolCallOut: lambda p, e: p.on_engine_tool_call(e.epoch, e.piece),
    ResponseFinished: lambda p, e: p.on_engine_finished(e.epoch, e.reason),
    SessionFailed: lambda p, e: p.on_engine_failed(e.message),
    DuplexOut: lambda p, e: p.on_engine_duplex(e.epoch, e.pcm, e.text, e.voiced, e.media_start),
    DuplexDropped: lambda p, e: p.on_duplex_dropped(e.n_samples, e.reason),
}


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
