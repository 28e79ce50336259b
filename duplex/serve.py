"""Run the app under uvicorn (uvloop, websockets) and exit 0 on SIGINT/SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from duplex.config import Settings
from duplex.observability import logs
from duplex.server import create_app
from duplex.transport.hub import SessionHub


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, hub: SessionHub, timeout_s: float) -> None:
        super().__init__(config)
        self.hub = hub
        self.timeout_s = timeout_s

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # With port 0 the system picks the port: say which, so whoever started us can connect.
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                logging.getLogger("duplex.server").info("listening on http://%s:%d", host, port)

    async def shutdown(self, sockets=None) -> None:
        # Sessions close themselves first (1001, their own reason); uvicorn would otherwise
        # cut every WebSocket with 1012 before the app hears of the shutdown.
        logging.getLogger("duplex.server").info("shutting down: closing %d open sessions", len(self.hub))
        await self.hub.close_all("server_shutdown", self.timeout_s)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after a clean shutdown, which makes the process
        # exit -15; a graceful stop on SIGTERM is a success, so only ask the server to exit.
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, self.handle_exit)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(settings: Settings) -> None:
    logs.configure(settings.server.log_level, settings.server.log_format)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        loop="uvloop",
        ws="websockets-sansio",
        ws_per_message_deflate=False,
        # Frames a little over the limit still arrive, so the client gets an error event first.
        ws_max_size=4 * settings.realtime.max_message_bytes,
        lifespan="on",
        log_level=settings.server.log_level,
        # uvicorn's own config would give its loggers text handlers; in JSON mode they go
        # through the root handler like everything else.
        log_config=None if settings.server.log_format == "json" else uvicorn.config.LOGGING_CONFIG,
        timeout_graceful_shutdown=int(settings.server.shutdown_timeout_s) + 1,
    )
    # After uvicorn.Config, which sets up uvicorn's loggers.
    logs.redact_server_credentials()
    _Server(config, app.state.hub, settings.server.shutdown_timeout_s).run()
