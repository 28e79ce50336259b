"""Logging: text for people, one JSON object a line for log pipelines. Records logged inside a
session's tasks carry its session_id and registry epoch, set once per session through
context variables (asyncio tasks inherit them), so no call site has to pass them."""

from __future__ import annotations

import contextvars
import json
import logging
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
