"""Logging: text for people, one JSON object a line for log pipelines. Records logged inside a
session's tasks carry its session_id and registry epoch, set once per session through
context variables (asyncio tasks inherit them), so no call site has to pass them."""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time

session_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("session_id", default=None)
epoch_var: contextvars.ContextVar[int | None] = contextvars.ContextVar("epoch", default=None)


def bind_session(session_id: str, epoch: int | None) -> None:
    session_id_var.set(session_id)
    epoch_var.set(epoch)


class SessionContext(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.session_id = session_id_var.get()
        record.epoch = epoch_var.get()
        return True


# Where a client's key travels, as uvicorn and websockets log it: the URL (`?api_key=`, the only
# place a browser can put it on a WebSocket), and, at debug level, the handshake's headers.
_CREDENTIALS = re.compile(
    r"(?i)([?&]api(?:_|%5f)key=|authorization:\s*(?:bearer\s+)?|openai-insecure-api-key\.)"
    r"[^&\s\"',]+")


class RedactCredentials(logging.Filter):
    """Uvicorn logs every URL it serves and, at debug level, every handshake header; the
    values of keys among them never reach the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _CREDENTIALS.sub(r"\1***", message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


def redact_server_credentials() -> None:
    for name in ("uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).addFilter(RedactCredentials())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("session_id", "epoch"):
            value = getattr(record, key, None)
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(SessionContext())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
