"""The TwiML that points a call at the Media Stream: `<Connect><Stream>` (bidirectional;
`<Start><Stream>` would only listen)."""

from __future__ import annotations

from xml.sax.saxutils import quoteattr

from starlette.requests import Request
from starlette.responses import Response

STREAM_PATH = "/telephony/twilio"
_WS_SCHEMES = {"https": "wss", "http": "ws"}


def stream_url(public_url: str, host: str) -> str:
    """The WebSocket URL Twilio dials: under `public_url` when set, else on the Host it used."""
    base = public_url.rstrip("/") or f"wss://{host}"
    scheme, _, rest = base.partition("://")
    return f"{_WS_SCHEMES.get(scheme, scheme)}://{rest}{STREAM_PATH}"


def twiml(url: str) -> str:
    return ('<?xml version="1.0" encoding="UTF-8"?>'
            f"<Response><Connect><Stream url={quoteattr(url)}/></Connect></Response>")


def twiml_endpoint(public_url: str):
    async def endpoint(request: Request) -> Response:
        return Response(twiml(stream_url(public_url, request.url.netloc)), media_type="text/xml")

    return endpoint
