"""The one builder of OpenAI's error body, for HTTP responses and Realtime `error` events.

OpenAI's clients read `error.type` and `error.code`; the SDKs pick their exception class from
the HTTP status. The type follows the status as OpenAI's API labels it.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPES = {429: "requests"}
"""OpenAI labels request-rate refusals "requests"; every other 4xx is invalid_request_error."""


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_object(kind: str, code: str, message: str, param: str | None = None,
                 event_id: str | None = None) -> dict[str, Any]:
    """The `error` object itself; `event_id` names the client event that caused it."""
    return {"type": kind, "code": code, "message": message, "param": param,
            "event_id": event_id}


def error_response(status: int, code: str, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_object(error_type(status), code, message, param)
    del body["event_id"]
    return JSONResponse({"error": body}, status, headers)
