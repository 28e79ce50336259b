"""The WebSocket edge of the Twilio bridge: one asyncio loop per call that feeds Twilio's
messages, engine results, VAD probabilities and clock ticks to the pure protocol in order, and
carries out the effects it returns. Same shape as the Realtime edge (realtime/ws.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from duplex.engine import AdmissionRefused, AudioOut, Engine, ResponseFinished, SessionFailed
from duplex.metrics import Metrics
from duplex.transport.realtime.protocol import (
    CloseConnection,
    EngineCancel,
    EngineCommit,
    EnginePush,
    Send,
    VadFeed,
)
from duplex.transport.realtime.ws import TICK_S
from duplex.transport.twilio.protocol import (
    RATE,
    DtmfReceived,
    Notice,
    Options,
    Rejected,
    TwilioProtocol,
)
from duplex.vad import VadService, VadStream

log = logging.getLogger("duplex.twilio")


class TwilioSession:
    def __init__(self, engine: Engine, vad: VadService, options: Options, metrics: Metrics,
                 send_text, *, session_id: str | None = None) -> None:
        self.engine = engine
        self.vad = vad
        self.metrics = metrics
        self.send_text = send_text
        self.session_id = session_id or "call_" + secrets.token_hex(8)
        self.protocol = TwilioProtocol(
            self.session_id,
            model_input_rate=engine.model.input_rate,
            model_output_rate=engine.model.output_rate,
            options=options,
        )
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.vad_stream = VadStream()
        self.t0 = time.monotonic_ns()
        self.close_code: int | None = None

    def now_sample(self) -> int:
        return (time.monotonic_ns() - self.t0) * RATE // 1_000_000_000

    def _post(self, item) -> None:
        # Engine and VAD threads may still answer after the call's loop has ended.
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)
            except RuntimeError:
                pass

    def open(self) -> None:
        """Admit the call into the engine; raises AdmissionRefused when over a limit."""
        self.engine.open(self.session_id, lambda event: self._post(("engine", event)))

    async def run(self) -> None:
        """Serve until Twilio hangs up or the protocol closes; then release everything and
        log the call's books (one JSON object: input accounting, replies, what was heard)."""
        ticker = asyncio.create_task(self._tick())
        try:
            await self._loop()
        finally:
            ticker.cancel()
            self.engine.close(self.session_id)
            summary = self.protocol.close()
            log.info("twilio call %s ended: %s", self.session_id, json.dumps(summary))

    def feed_text(self, text: str) -> None:
        self.inbox.put_nowait(("text", text))

    def feed_bytes(self, data: bytes) -> None:
        self.inbox.put_nowait(("bytes", data))

    def carrier_gone(self) -> None:
        self.inbox.put_nowait(("gone",))

    async def shutdown(self, reason: str) -> None:
        self.inbox.put_nowait(("close", 1001, reason))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.inbox.put_nowait(("tick",))

    async def _loop(self) -> None:
        p = self.protocol
        while True:
            item = await self.inbox.get()
            kind = item[0]
            if kind == "gone":
                return
            if kind == "close":
                self.close_code = item[1]
                return
            if kind == "text":
                effects = p.receive_text(item[1])
            elif kind == "bytes":
                effects = p.receive_bytes(item[1])
            elif kind == "vad":
                effects = p.on_vad(item[1])
            elif kind == "engine" and isinstance(item[1], AudioOut):
                effects = p.on_engine_audio(item[1].epoch, item[1].pcm, item[1].text)
            elif kind == "engine" and isinstance(item[1], ResponseFinished):
                effects = p.on_engine_finished(item[1].epoch)
            elif kind == "engine" and isinstance(item[1], SessionFailed):
                effects = p.on_engine_failed(item[1].message)
            else:
                effects = []
            effects += p.release_output(self.now_sample())
            if await self._execute(effects):
                return

    async def _execute(self, effects) -> bool:
        """Carry out effects in order; True when the call must end."""
        sid = self.session_id
        for effect in effects:
            if isinstance(effect, Send):
                await self.send_text(json.dumps(effect.event))
            elif isinstance(effect, EnginePush):
                self.engine.push_audio(sid, effect.pcm)
            elif isinstance(effect, VadFeed):
                self.vad.submit(self.vad_stream, effect.pcm, lambda probs: self._post(("vad", probs)))
            elif isinstance(effect, EngineCommit):
                self.engine.commit(sid, effect.epoch)
            elif isinstance(effect, EngineCancel):
                self.engine.cancel(sid, effect.epoch)
            elif isinstance(effect, Rejected):
                log.warning("twilio call %s: rejected (%s): %s", sid, effect.reason, effect.message)
                self.metrics.telephony_rejected.labels(effect.reason).inc()
            elif isinstance(effect, DtmfReceived):
                log.info("twilio call %s: DTMF %s", sid, effect.digit)
                self.metrics.telephony_dtmf.labels(effect.digit).inc()
            elif isinstance(effect, Notice):
                log.info("twilio call %s: %s", sid, effect.message)
            elif isinstance(effect, CloseConnection):
                self.close_code = effect.code
                return True
        return False


def twilio_endpoint(engine_getter, vad_getter, options: Options, metrics: Metrics, hub):
    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        session = TwilioSession(engine_getter(), vad_getter(), options, metrics, ws.send_text)
        try:
            session.open()
        except AdmissionRefused as exc:
            # Twilio has no error message to carry this; the close reason and the log do.
            log.warning("twilio call refused: %s", exc)
            await ws.close(1013, "server full")
            return
        hub.add(session.session_id, session.shutdown)

        async def read() -> None:
            try:
                while True:
                    message = await ws.receive()
                    if message["type"] == "websocket.disconnect":
                        break
                    if message.get("text") is not None:
                        session.feed_text(message["text"])
                    elif message.get("bytes") is not None:
                        session.feed_bytes(message["bytes"])
            except WebSocketDisconnect:
                pass
            session.carrier_gone()

        reader = asyncio.create_task(read())
        try:
            await session.run()
        finally:
            reader.cancel()
            hub.discard(session.session_id)
            if ws.application_state is WebSocketState.CONNECTED:
                try:
                    await ws.close(session.close_code or 1000)
                except RuntimeError:
                    pass

    return endpoint
