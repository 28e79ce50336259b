"""Prometheus metrics, one registry per app so several apps in one process stay apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from duplex import __version__


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        Info("duplex_build", "Server version and model", registry=self.registry).info(
            {"version": __version__, "model": model}
        )
        self.active_sessions = Gauge(
            "duplex_active_sessions", "Sessions open on this node", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
