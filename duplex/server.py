"""The ASGI app: health, metrics, the web client, and (as transports land) the session APIs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import replace
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from duplex import __version__
from duplex.access.auth import CLIENT_SECRETS_PATH, AuthMiddleware, Gate
from duplex.access.limits import Admission
from duplex.config import Settings
from duplex.engine import (
    AdmissionRefused,
    ChildSpec,
    EngineConfig,
    SchedulerConfig,
    start_engine,
)
from duplex.engine.vad import VadService
from duplex.media.echo import warm_up as echo_guard_warm_up
from duplex.observability.metrics import Metrics
from duplex.smart_turn import SmartTurn, TurnEndService, resolve
from duplex.store import SessionRegistry, open_store
from duplex.store.seats import RedisSeats
from duplex.transcription import Transcriber
from duplex.transport.hub import SessionHub
from duplex.transport.realtime.client_secrets import client_secrets_endpoint
from duplex.transport.realtime.protocol import Limits
from duplex.transport.realtime.ws import realtime_endpoint
from duplex.transport.twilio.protocol import Options as TwilioOptions
from duplex.transport.twilio.twiml import twiml_endpoint
from duplex.transport.twilio.ws import twilio_endpoint
from duplex.transport.webrtc.calls import CallRegistry
from models.caches import CacheBudgets

METRICS_SYNC_S = 5.0
METRICS_FRESH_S = 1.0
"""How long /metrics waits for the engine's figures as of the request, before it answers
with those it has."""
WEB_CLIENT_DIR = Path(__file__).resolve().parent.parent / "web_client"
log = logging.getLogger("duplex.server")


def engine_spec(settings: Settings) -> ChildSpec:
    """What the engine is started with: the model and engine sections of the settings."""
    es = settings.engine
    return ChildSpec(
        model_name=settings.model.name,
        cache_dir=settings.model.cache_dir,
        device=settings.model.device,
        config=EngineConfig(
            max_sessions=es.max_sessions,
            max_load=es.max_load,
            scheduler=SchedulerConfig(max_batch=es.max_batch, audio_lead_s=es.audio_lead_s),
            duplex_max_lag_ms=settings.duplex.max_lag_ms,
        ),
        torch_threads=es.torch_threads,
        log_level=settings.server.log_level,
        log_format=settings.server.log_format,
        caches=CacheBudgets(settings.caches.prefix_bytes, settings.caches.feature_bytes),
        dtype=settings.model.dtype,
        cuda_graphs=es.cuda_graphs,
        pin_cpus=es.pin_cpus,
        kv_memory=es.kv_memory,
    )


def create_app(settings: Settings) -> Starlette:
    hub = SessionHub()
    ss = settings.store
    node_id = ss.node_id or f"{socket.gethostname()}-{os.getpid()}"
    # Expired sessions are remembered as long again, so a late resume hears "expired".
    store = open_store(ss.backend, ss.redis_url, tombstone_s=ss.retention_s)
    registry = SessionRegistry(store, node_id, ss.retention_s,
                               context_max_bytes=ss.context_max_bytes,
                               keep_live_s=ss.keep_live_s)
    metrics = Metrics(settings.model.name)
    lim = settings.limits
    # Without a session limit there is nothing to count, so nothing goes to Redis.
    seats = (RedisSeats(store.redis, lim, ss.heartbeat_s,
                        on_fallback=metrics.seats_local_fallback.inc)
             if ss.backend == "redis" and (lim.sessions or lim.sessions_per_key) else None)
    admission = Admission(lim, seats=seats, on_refused=metrics.count_refusal)
    gate = Gate(settings.auth, settings.telephony, registry, admission)
    duplex_default = settings.duplex.default_mode.get(settings.model.name) == "duplex"
    metrics.active_sessions.set_function(lambda: len(hub))

    async def healthz(_request: Request) -> JSONResponse:
        engine = parts.get("engine")
        # A server whose engine has died answers nothing useful, and one that would refuse a
        # new session (an engine limit, KV memory) takes none: say so to load balancers.
        up = engine is not None and engine.alive
        refused = None
        if up:
            try:
                engine.admit()
            except AdmissionRefused as exc:
                refused = exc
        info = getattr(engine, "model", None)
        native = info is not None and info.duplex_delay_frames is not None
        body = {
            "status": "engine_down" if not up else "full" if refused else "ok",
            "version": __version__,
            "model": settings.model.name,
            "active_sessions": len(hub),
            "node_id": node_id,
            "store": ss.backend,
            "duplex": native,
            "duplex_default": native and duplex_default,
            "kv": {stage: {"blocks_total": pool.blocks_total, "blocks_used": pool.blocks_used,
                           "blocks_free": pool.blocks_free, "block_bytes": pool.block_bytes}
                   for stage, pool in getattr(engine, "kv_stats", {}).items()},
            # What the model prepared and checked at start; "warnings" say what is slow.
            "model_startup": info.startup if info is not None else {},
        }
        if refused is not None:
            body.update(limit=refused.limit, message=str(refused))
        return JSONResponse(body, status_code=200 if up and refused is None else 503)

    async def metrics_endpoint(_request: Request) -> Response:
        if "engine" in parts:
            engine = parts["engine"]
            # The engine reports every quarter second; a barrier brings its figures up to
            # this request (a reply just finished is in its counters).
            await asyncio.to_thread(engine.wait_idle, METRICS_FRESH_S)
            metrics.sync_engine(engine)
        return Response(metrics.render(), media_type=metrics.content_type)

    parts: dict[str, object] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):
        es = settings.engine
        spec = engine_spec(settings)
        engine = await asyncio.to_thread(start_engine, spec, not es.process)
        ts = settings.transcription
        transcriber = await asyncio.to_thread(Transcriber, ts.model, ts.max_queue)
        await asyncio.to_thread(echo_guard_warm_up)
        turns = settings.turns
        turn_path = await asyncio.to_thread(resolve, turns.model, settings.model.cache_dir)
        turn_end = (TurnEndService(SmartTurn(turn_path, turns.threads))
                    if turn_path is not None else None)
        parts.update(engine=engine, vad=VadService(turn_end=turn_end), transcriber=transcriber)
        model = engine.model
        log.info("model %s loaded on %s (%s)%s", model.name, model.device, model.dtype,
                 " in the engine process" if es.process else "")

        async def drain_engine_stats() -> None:
            # The engine keeps raw per-step samples until they move into the histograms; a
            # server nobody scrapes must not keep them forever.
            while True:
                await asyncio.sleep(METRICS_SYNC_S)
                metrics.sync_engine(engine)

        syncer = asyncio.create_task(drain_engine_stats())
        yield
        syncer.cancel()
        registry.live.close_all()
        engine.stop()
        parts["vad"].stop()
        transcriber.stop()
        await admission.seats.close()
        await store.close()

    rs = settings.realtime
    limits = Limits(
        max_message_bytes=rs.max_message_bytes,
        max_input_lead_ms=rs.max_input_lead_ms,
        output_lead_ms=rs.output_lead_ms,
        max_errors=rs.max_errors,
        mcp_timeout_s=rs.mcp_timeout_s,
    )
    calls = CallRegistry(
        lambda: parts["engine"], lambda: parts["vad"],
        replace(limits, output_lead_ms=settings.webrtc.output_lead_ms), settings.model.name, hub,
        settings.webrtc, admission=gate.admission, transcriber_getter=lambda: parts["transcriber"],
        duplex_default=duplex_default,
    )
    realtime = realtime_endpoint(
        lambda: parts["engine"], lambda: parts["vad"], limits, settings.model.name, hub,
        registry=registry, heartbeat_s=ss.heartbeat_s, metrics=metrics,
        transcriber_getter=lambda: parts["transcriber"], duplex_default=duplex_default,
    )

    ts = settings.telephony
    twilio = twilio_endpoint(
        lambda: parts["engine"], lambda: parts["vad"],
        TwilioOptions(output_lead_ms=ts.output_lead_ms, end_call_digit=ts.end_call_digit,
                      duplex=duplex_default,
                      min_interruption_ms=ts.min_interruption_ms,
                      turn_detection=ts.turn_detection, eagerness=ts.eagerness,
                      noise_reduction=ts.noise_reduction or None),
        metrics, hub,
    )

    routes = [
        Route("/healthz", healthz),
        Route("/metrics", metrics_endpoint),
        Route(CLIENT_SECRETS_PATH, client_secrets_endpoint(gate, settings.model.name),
              methods=["POST"]),
        Route("/v1/realtime/calls", calls.create, methods=["POST"]),
        Route("/v1/realtime/calls/{call_id}/hangup", calls.hangup, methods=["POST"]),
        WebSocketRoute("/v1/realtime", realtime),
        WebSocketRoute("/realtime", realtime),
        Route("/telephony/twilio/twiml", twiml_endpoint(ts.public_url), methods=["POST"]),
        WebSocketRoute("/telephony/twilio", twilio),
        Mount("/", StaticFiles(directory=WEB_CLIENT_DIR, html=True), name="web_client"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(AuthMiddleware, gate=gate)])
    app.state.settings = settings
    app.state.hub = hub
    app.state.registry = registry
    app.state.metrics = metrics
    return app
