"""The WebSocket edge of the Realtime protocol: accept the connection, admit a RealtimeSession
(session.py) and serve it until either side ends it; or, with `?call_id=`, attach it to a live
call as a sideband (duplex.transport.sideband)."""

from __future__ import annotations

import contextlib
import json

from starlette.websockets import WebSocket

from duplex.access.auth import choose_subprotocol
from duplex.access.errors import error_object
from duplex.engine import AdmissionRefused
from duplex.observability.metrics import Metrics
from duplex.store import SessionRegistry
from duplex.transport.loop import PEER_GONE, close_quietly, serve_websocket
from duplex.transport.realtime.protocol import Limits
from duplex.transport.realtime.session import RealtimeSession
from duplex.transport.sideband import serve_sideband


def admission_error(exc: AdmissionRefused) -> str:
    return json.dumps({"type": "error", "event_id": "event_admission",
                       "error": error_object("server_error", "server_full", str(exc), exc.limit)})


def realtime_endpoint(engine_getter, vad_getter, limits: Limits, model_name: str, hub, *,
                      registry: SessionRegistry | None = None, heartbeat_s: float = 2.0,
                      metrics: Metrics | None = None, transcriber_getter=lambda: None,
                      duplex_default: bool = False):
    async def endpoint(ws: WebSocket) -> None:
        if "call_id" in ws.query_params:
            await serve_sideband(ws, hub.calls)
            return
        await ws.accept(subprotocol=choose_subprotocol(ws.scope.get("subprotocols", [])))
        beta = ws.headers.get("openai-beta", "").replace(" ", "").startswith("realtime=v1")
        duplex_events = ws.query_params.get("duplex_events", "").lower() in ("1", "true")
        # Set by the auth middleware: who connected, and the limits their messages draw on.
        state = ws.scope.get("state", {})
        principal = state.get("principal")
        session = RealtimeSession(engine_getter(), vad_getter(), limits, model_name, ws.send_text,
                                  beta=beta, registry=registry, heartbeat_s=heartbeat_s,
                                  quota=state.get("quota"), metrics=metrics,
                                  session_id=state.get("session_id"), place=state.get("place"),
                                  duplex_events=duplex_events,
                                  transcriber=transcriber_getter(),
                                  duplex_default=duplex_default)
        if ws.query_params.get("intent") == "transcription":
            session.protocol.configure({"type": "transcription"})
        if principal is not None and principal.session:
            session.protocol.configure(principal.session)
        try:
            session.open()
        except AdmissionRefused as exc:
            with contextlib.suppress(*PEER_GONE):
                await ws.send_text(admission_error(exc))
            await close_quietly(ws, 1013, "server full")
            return
        await serve_websocket(ws, session, hub)

    return endpoint
