"""The WebSocket edge of the Twilio bridge: one asyncio loop per call that feeds Twilio's
messages, engine results, VAD probabilities and clock ticks to the pure protocol in order, and
carries out the effects it returns. Same shape as the Realtime edge (realtime/ws.py).
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
from duplex.transport.loop import SessionLoop, close_quietly, serve_websocket
from duplex.transport.twilio.protocol import (
    INPUT_TRACK,
    RATE,
    BargedIn,
    DtmfReceived,
    InterruptionJudged,
    Notice,
    Options,
    Rejected,
    TwilioProtocol,
)

log = logging.getLogger("duplex.twilio")


class TwilioSession(SessionLoop):
    rate = RATE

    def __init__(self, engine: Engine, vad: VadService, options: Options, metrics: Metrics,
                 send_text, *, session_id: str | None = None) -> None:
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
        )
        super().__init__(engine, vad, send_text, session_id, protocol)
        self.metrics = metrics

    async def ended(self) -> None:
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
        else:
            return await super().carry_out(effect)
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
            await close_quietly(ws, 1013, "server full")
            return
        await serve_websocket(ws, session, hub)

    return endpoint
