"""The error a client event causes: its code, message and the parameter it names. The
protocol answers it with an `error` event (duplex.access.errors builds the body) and goes on."""

from __future__ import annotations

from duplex.transport.realtime.session_config import ConfigError


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param

    @classmethod
    def of(cls, exc: ConfigError) -> ProtocolError:
        return cls(exc.code, str(exc), exc.param)
