"""The WebSocket edge of the Twilio bridge: one asyncio loop per call that feeds Twilio's
messages, engine results, VAD probabilities and clock ticks to the pure protocol in order, and
carries out the effects it returns. Same shape as the Realtime edge (realtime/ws.py).

Once its stream starts, a call is live in the hub by Twilio's CallSid and by its StreamSid:
sidebands (`/v1/realtime?call_id=`) attach to it by either, and see it through its Realtime
view (realtime_view.py).
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import replace

from starlette.websockets import WebSocket

from duplex.engine import AdmissionRefused, Engine
from duplex.engine.vad import VadService
from duplex.observability.metrics import Metrics
from duplex.transport.inbox import FromSideband, Message
from duplex.transport.loop import SessionLoop, close_quietly, serve_websocket
from duplex.transport.sideband import Sidebands
from duplex.transport.twilio.protocol import (
    INPUT_TRACK,
    RATE,
    BargedIn,
    DtmfReceived,
    InterruptionJudged,
    Notice,
    Options,
    Rejected,
    StreamStarted,
    TwilioProtocol,
)
from duplex.transport.twilio.realtime_view import Publish

log = logging.getLogger("duplex.twilio")


TWILIO_SIGNED = "twilio"
"""The key id of a stream that Twilio's signature admitted (duplex.access.auth)."""


class TwilioCall:
    """A Twilio call as sidebands attach to it (duplex.transport.sideband.LiveCall)."""

    def __init__(self, session: TwilioSession, owner: str | None) -> None:
        self.session = session
        self.owner = owner
        self.sidebands = Sidebands()

    def attached_event(self) -> str | None:
        return json.dumps(self.session.protocol.view.attached())

    def feed_text(self, text: str) -> None:
        self.session.inbox.put(FromSideband(text))

    def feed_bytes(self, data: bytes) -> None:
        self.session.inbox.put(FromSideband(data))


class TwilioSession(SessionLoop):
    rate = RATE

    def __init__(self, engine: Engine, vad: VadService, options: Options, metrics: Metrics,
                 send_text, *, session_id: str | None = None, hub=None,
                 key_id: str = TWILIO_SIGNED) -> None:
        session_id = session_id or "call_" + secrets.token_hex(8)
        # A duplex default names the model; one without a duplex mode takes turns.
        native = engine.model.duplex_delay_frames is not None
        options = replace(options, duplex=options.duplex and native,
                          turn_model=vad.turn_end is not None)
        protocol = TwilioProtocol(
            session_id,
            model_input_rate=engine.model.input_rate,
            model_output_rate=engine.model.output_rate,
            options=options,
            model=engine.model.name,
        )
        super().__init__(engine, vad, send_text, session_id, protocol)
        self.metrics = metrics
        self.hub = hub
        # A stream Twilio opened belongs to the server, not to a key: any client the server
        # admits may attach to it. One opened with a key needs that key, as a WebRTC call does.
        self.call = TwilioCall(self, None if key_id == TWILIO_SIGNED else key_id)
        self.call_ids: list[str] = []
        """The ids this call is live under in the hub."""

    def dispatch(self, message: Message) -> list:
        if isinstance(message, FromSideband):
            return self.protocol.receive_sideband(message.data)
        return super().dispatch(message)

    async def ended(self) -> None:
        for call_id in self.call_ids:
            self.hub.calls.pop(call_id, None)
        self.call.sidebands.close()
        # The call's books in one line: input accounting, replies and what was heard of them.
        summary = self.protocol.close()
        log.info("twilio call %s ended: %s", self.session_id, json.dumps(summary))
        for reason, n in summary["input"]["dropped"].items():
            self.metrics.dropped.labels(INPUT_TRACK, reason).inc(n)

    async def carry_out(self, effect) -> bool:
        sid = self.session_id
        if isinstance(effect, Rejected):
            log.warning("twilio call %s: rejected (%s): %s", sid, effect.reason, effect.message)
            self.metrics.telephony_rejected.labels(effect.reason).inc()
        elif isinstance(effect, DtmfReceived):
            log.info("twilio call %s: DTMF %s", sid, effect.digit)
            self.metrics.telephony_dtmf.labels(effect.digit).inc()
        elif isinstance(effect, BargedIn):
            self.metrics.barge_in.observe(max(0, self.now_sample() - effect.onset_sample) / RATE)
        elif isinstance(effect, Notice):
            log.info("twilio call %s: %s", sid, effect.message)
        elif isinstance(effect, InterruptionJudged):
            self.metrics.count_interruption(effect.confirmed)
        elif isinstance(effect, Publish):
            self.call.sidebands.publish(json.dumps(effect.event))
        elif isinstance(effect, StreamStarted):
            self._go_live(effect)
        else:
            return await super().carry_out(effect)
        return False


    def _go_live(self, started: StreamStarted) -> None:
        """Attachable by either id; an id another live call holds stays that call's."""
        if self.hub is None:
            return
        for call_id in (started.call_sid, started.stream_sid):
            if call_id not in self.hub.calls:
                self.hub.calls[call_id] = self.call
                self.call_ids.append(call_id)


def twilio_endpoint(engine_getter, vad_getter, options: Options, metrics: Metrics, hub):
    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        principal = ws.scope.get("state", {}).get("principal")
        session = TwilioSession(engine_getter(), vad_getter(), options, metrics, ws.send_text,
                                hub=hub, key_id=principal.key_id if principal else "anonymous")
        try:
            session.open()
        except AdmissionRefused as exc:
            # Twilio has no error message to carry this; the close reason and the log do.
            log.warning("twilio call refused: %s", exc)
            await close_quietly(ws, 1013, "server full")
            return
        await serve_websocket(ws, session, hub)

    return endpoint
