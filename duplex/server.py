"""The ASGI app: health, metrics, the web client, and (as transports land) the session APIs."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from duplex import __version__
from duplex.config import Settings
from duplex.hub import SessionHub
from duplex.metrics import Metrics

WEB_CLIENT_DIR = Path(__file__).resolve().parent.parent / "web_client"
log = logging.getLogger("duplex.server")


def create_app(settings: Settings) -> Starlette:
    hub = SessionHub()
    metrics = Metrics(settings.model.name)
    metrics.active_sessions.set_function(lambda: len(hub))

    async def healthz(_request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "version": __version__,
                "model": settings.model.name,
                "active_sessions": len(hub),
            }
        )

    async def metrics_endpoint(_request: Request) -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette):
        yield
        log.info("shutting down: closing %d open sessions", len(hub))
        await hub.close_all("server_shutdown", settings.server.shutdown_timeout_s)

    routes = [
        Route("/healthz", healthz),
        Route("/metrics", metrics_endpoint),
        Mount("/", StaticFiles(directory=WEB_CLIENT_DIR, html=True), name="web_client"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.settings = settings
    app.state.hub = hub
    app.state.metrics = metrics
    return app
