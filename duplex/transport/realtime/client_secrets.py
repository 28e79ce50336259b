"""POST /v1/realtime/client_secrets: mint a short-lived key that opens one session with the
settings it was minted for (validated here, as session.update would).

The settings are kept in the session registry (Redis in a cluster) until the key is used, so a
key never carries an MCP server's `headers` or `authorization`: those are secrets, and the
registry is no place for them. The key is refused, with the tool named; the server that minted
it gives the MCP tool its headers itself, through the call's sideband (`/v1/realtime?call_id=`)
or its own session.update, where they live only in the session's memory.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from duplex.access.auth import Gate
from duplex.access.errors import error_response
from duplex.store import StoreUnavailable
from duplex.transport.realtime.session_config import (
    ConfigError,
    SessionSettings,
    ga_session,
    updated_ga,
)

_STORE_DOWN = "The session registry cannot be reached."


def client_secrets_endpoint(gate: Gate, model_name: str):
    async def endpoint(request: Request) -> Response:
        try:
            principal = await gate.authenticate(request, allow_ephemeral=False)
        except StoreUnavailable:
            return error_response(503, "session_store_unavailable", _STORE_DOWN)
        if principal is None:
            return error_response(401, "invalid_api_key",
                                  "An API key (not an ephemeral key) is required.",
                                  headers={"WWW-Authenticate": "Bearer"})
        try:
            body = json.loads(await request.body() or b"{}")
            ttl, session = _parse_request(body, gate.auth.ephemeral_key_ttl_s)
            settings = updated_ga(SessionSettings(), session)
            _refuse_secrets(session)
        except ValueError as exc:
            return error_response(400, "invalid_value", str(exc), getattr(exc, "param", None))
        session_id = "sess_" + secrets.token_hex(8)
        try:
            value, expires_at = await gate.registry.issue_key(principal.key_id, session_id,
                                                              session, ttl)
        except StoreUnavailable:
            return error_response(503, "session_store_unavailable", _STORE_DOWN)
        return JSONResponse({"value": value, "expires_at": int(expires_at),
                             "session": ga_session(settings, session_id, model_name)})

    return endpoint


def _parse_request(body: Any, default_ttl: int) -> tuple[int, dict[str, Any]]:
    if not isinstance(body, dict):
        raise ValueError("The body must be a JSON object.")
    expires = body.get("expires_after") or {}
    if not isinstance(expires, dict) or expires.get("anchor", "created_at") != "created_at":
        raise ValueError("expires_after.anchor must be 'created_at'.")
    ttl = expires.get("seconds", default_ttl)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 10 <= ttl <= 7200:
        raise ValueError("expires_after.seconds must be an integer from 10 to 7200.")
    session = body.get("session") or {}
    if not isinstance(session, dict):
        raise ValueError("session must be an object.")
    return ttl, session


def _refuse_secrets(session: dict[str, Any]) -> None:
    """An MCP tool with headers or an authorization (ConfigError naming it); run after the
    session validated, so `tools` is a list of objects."""
    for i, tool in enumerate(session.get("tools") or ()):
        if tool.get("type") != "mcp":
            continue
        for name in ("headers", "authorization"):
            if tool.get(name):
                raise ConfigError(
                    "invalid_value",
                    f"Invalid value for 'session.tools.{i}.{name}': the MCP tool "
                    f"'{tool['server_label']}' cannot keep its {name} in an ephemeral key, "
                    "which the session registry stores until it is used. Give the tool with "
                    f"its {name} from your server: session.update on the call's sideband "
                    "(/v1/realtime?call_id=...).",
                    f"session.tools.{i}.{name}")
