"""Authentication and admission at every session entry point, as one ASGI middleware, and the
ephemeral-key endpoint.

A client proves itself with an API key from `[auth] api_keys` or with an ephemeral `ek_` key
minted from one: as `Authorization: Bearer KEY`, or (browsers cannot set headers on a
WebSocket) as `?api_key=KEY` or the subprotocol `openai-insecure-api-key.KEY`. Twilio, which
can do neither, is recognised by its X-Twilio-Signature. A refused WebSocket handshake gets a
real HTTP status (401, 429, 503), not an accepted-then-closed socket.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from starlette.requests import HTTPConnection

from duplex.access.errors import error_response
from duplex.access.limits import Admission, OverLimit
from duplex.config import AuthSettings, TelephonySettings
from duplex.store import SessionRegistry, StoreUnavailable, hash_secret

KEY_SUBPROTOCOL = "openai-insecure-api-key."
SESSION_PATHS = ("/v1/realtime", "/realtime")
"""WebSocket sessions: counted against the concurrency limits while they last."""
PROTECTED_PREFIXES = ("/v1/realtime/calls", "/telephony")
CLIENT_SECRETS_PATH = "/v1/realtime/client_secrets"


@dataclass(frozen=True)
class Principal:
    key_id: str
    """Whose limits a session counts against: a hash of the API key, or 'anonymous'."""
    session_id: str | None = None
    session: dict[str, Any] | None = None
    """Settings an ephemeral key was minted with, applied before session.created."""


def key_id_of(key: str) -> str:
    return "key_" + hash_secret(key)[:12]


def presented_key(conn: HTTPConnection) -> str | None:
    scheme, _, value = conn.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    for proto in conn.scope.get("subprotocols", []):
        if proto.startswith(KEY_SUBPROTOCOL):
            return proto[len(KEY_SUBPROTOCOL):]
    return conn.query_params.get("api_key")


def choose_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to accept: browsers fail a handshake that answers none of theirs, and
    the one carrying the key must never be echoed back."""
    usable = [p for p in offered if not p.startswith(KEY_SUBPROTOCOL)]
    if "realtime" in usable:
        return "realtime"
    return usable[0] if usable else None


def twilio_signature(auth_token: str, url: str, params: list[tuple[str, str]]) -> str:
    """Twilio's scheme: HMAC-SHA1 over the URL followed by each POST parameter's name and value,
    sorted by name; base64."""
    data = url + "".join(name + value for name, value in sorted(params))
    digest = hmac.new(auth_token.encode(), data.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode()


def _signed_urls(conn: HTTPConnection, public_url: str) -> list[str]:
    """The URLs Twilio may have signed: it signs what it dialled, which behind a TLS-terminating
    balancer is the public https/wss URL, not the one this process sees."""
    path = conn.url.path + (f"?{conn.url.query}" if conn.url.query else "")
    secure = "wss" if conn.scope["type"] == "websocket" else "https"
    bases = [f"{scheme}://{conn.url.netloc}" for scheme in (secure, conn.url.scheme)]
    if public_url:
        scheme, _, rest = public_url.rstrip("/").partition("://")
        base_path = "/" + rest.partition("/")[2] if "/" in rest else ""
        host = rest.split("/", 1)[0]
        # A prefix in public_url is one the balancer strips before the request reaches us.
        bases += [f"{s}://{host}{base_path}" for s in (secure, scheme)]
    return list(dict.fromkeys(base + path for base in bases))


class Gate:
    def __init__(self, auth: AuthSettings, telephony: TelephonySettings,
                 registry: SessionRegistry, admission: Admission) -> None:
        self.keys = {hash_secret(k): key_id_of(k) for k in auth.api_keys}
        self.auth = auth
        self.telephony = telephony
        self.registry = registry
        self.admission = admission

    @property
    def required(self) -> bool:
        return bool(self.keys)

    async def authenticate(self, conn: HTTPConnection, *,
                           allow_ephemeral: bool = True) -> Principal | None:
        """Who is asking, or None when a key is required and none valid was shown.
        An ephemeral key is used up by this call. Raises StoreUnavailable."""
        key = presented_key(conn)
        if key and key.startswith("ek_") and allow_ephemeral:
            ek = await self.registry.take_key(key)
            if ek is not None:
                return Principal(ek.key_id, ek.session_id, ek.session)
        elif key:
            digest = hash_secret(key)
            for known, key_id in self.keys.items():
                if hmac.compare_digest(digest, known):
                    return Principal(key_id)
        return None if self.required else Principal("anonymous")

    def twilio_signed(self, conn: HTTPConnection, params: list[tuple[str, str]]) -> bool:
        token = self.telephony.auth_token
        signature = conn.headers.get("x-twilio-signature")
        if not token or not signature:
            return False
        return any(hmac.compare_digest(twilio_signature(token, url, params), signature)
                   for url in _signed_urls(conn, self.telephony.public_url))


class AuthMiddleware:
    def __init__(self, app, gate: Gate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        session = scope["type"] == "websocket" and path in SESSION_PATHS
        protected = session or path.startswith(PROTECTED_PREFIXES)
        if scope["type"] not in ("http", "websocket") or not protected:
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        twilio = path.startswith("/telephony") and bool(self.gate.telephony.auth_token)
        params: list[tuple[str, str]] = []
        if twilio and scope["type"] == "http":
            body, receive = await _buffer_body(receive)
            params = parse_qsl(body.decode("latin-1"), keep_blank_values=True)
        try:
            principal = await self.gate.authenticate(conn)
        except StoreUnavailable:
            await self._deny(scope, receive, send, 503, "session_store_unavailable",
                             "The session registry cannot be reached; try again.")
            return
        # With an auth token set, Twilio's signature is required even where no API key is.
        if twilio and (principal is None or principal.key_id == "anonymous"):
            principal = Principal("twilio") if self.gate.twilio_signed(conn, params) else None
        if principal is None:
            await self._deny(scope, receive, send, 401, "invalid_api_key",
                             "Missing or invalid API key (or expired ephemeral key). Send "
                             "'Authorization: Bearer KEY'.")
            return
        state = scope.setdefault("state", {})
        state["principal"] = principal
        place = None
        # A sideband (`?call_id=`) joins a call's session: it takes no seat of its own.
        sideband = session and "call_id" in conn.query_params
        if scope["type"] == "websocket" and not sideband:
            # The session's id is chosen here, so that its seat bears it (a resume elsewhere
            # moves onto that seat).
            state["session_id"] = principal.session_id or "sess_" + secrets.token_hex(8)
            seat_id = await self._resumed_here(conn) if session else None
            try:
                place = await self.gate.admission.enter(principal.key_id,
                                                        seat_id or state["session_id"])
            except OverLimit as over:
                await self._deny(scope, receive, send, 429, "rate_limit_exceeded",
                                 str(over), retry_after=1)
                return
            state["place"] = place
            state["quota"] = self.gate.admission.quota(principal.key_id)
        try:
            await self.app(scope, receive, send)
        finally:
            if place is not None:
                self.gate.admission.leave(place)

    async def _resumed_here(self, conn: HTTPConnection) -> str | None:
        """The session this connection names to resume at the handshake
        (`?resume_session_id=...&resume_token=...`), if the token proves it: its seat is
        taken over, so a session resumed at the cluster's limit is admitted."""
        session_id = conn.query_params.get("resume_session_id")
        token = conn.query_params.get("resume_token")
        if session_id and token and await self.gate.registry.resumable(session_id, token):
            return session_id
        return None

    @staticmethod
    async def _deny(scope, receive, send, status: int, code: str, message: str,
                    retry_after: int | None = None) -> None:
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        response = error_response(status, code, message, headers=headers)
        if scope["type"] == "http":
            await response(scope, receive, send)
            return
        await receive()  # websocket.connect
        if "websocket.http.response" in scope.get("extensions", {}):
            await response(scope, receive, send)
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": code})


async def _buffer_body(receive):
    """Read a request body that the middleware needs, and hand the app an identical stream."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay
