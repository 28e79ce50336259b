"""The server as an MCP client (the asyncio edge of mcp.py): list a server's tools, call one,
through the official `mcp` SDK over streamable HTTP, or SSE for a URL whose path ends in
`/sse`. One connection per listing or call, each bounded by the session's MCP timeout.

Nothing here raises for what a server does: a failure comes back as the error object of
OpenAI's MCP items ({type: http_error | protocol_error | tool_execution_error, code?,
message}), so the session goes on. The server's headers go in its requests and nowhere else.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

from duplex.transport.realtime.mcp import McpServer

MAX_PAGES = 20
"""tools/list pages read at most (a server that pages without end cannot hold a session)."""
UNREACHABLE = 502
"""The http_error code for a server that could not be reached (as a gateway says it)."""
TIMED_OUT = 504


async def list_tools(server: McpServer, timeout_s: float
                     ) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
    """(the server's tools as Realtime's mcp_list_tools item lists them, None), or
    (None, why not)."""

    async def listing(client) -> list[dict[str, Any]]:
        tools, cursor = [], None
        for _ in range(MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            tools += [_tool(t) for t in page.tools]
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    return await _session(server, timeout_s, listing)


async def call_tool(server: McpServer, tool: str, arguments: dict[str, Any], timeout_s: float
                    ) -> tuple[str | None, dict[str, Any] | None]:
    """(the tool's output as text, None), or (None, why there is none)."""

    async def calling(client):
        return await client.call_tool(tool, arguments)

    result, error = await _session(server, timeout_s, calling)
    if error is not None:
        return None, error
    text = _text(result)
    if result.is_error:
        return None, {"type": "tool_execution_error", "message": text or f"{tool} failed"}
    return text, None


async def _session(server: McpServer, timeout_s: float, work) -> tuple[Any, dict | None]:
    # The SDK is imported here, not with the module: most sessions never use MCP, and it is
    # a large import for a server's start.
    import httpx2
    from mcp import Client
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client
    from mcp.shared.exceptions import MCPError

    try:
        async with asyncio.timeout(timeout_s):
            if urlsplit(server.url).path.rstrip("/").endswith("/sse"):
                transport = sse_client(server.url, headers=server.headers, timeout=timeout_s,
                                       sse_read_timeout=timeout_s)
                async with Client(transport, mode="legacy", cache=None) as client:
                    return await work(client), None
            async with create_mcp_http_client(headers=server.headers,
                                              timeout=httpx2.Timeout(timeout_s)) as http:
                transport = streamable_http_client(server.url, http_client=http)
                async with Client(transport, mode="legacy", cache=None) as client:
                    return await work(client), None
    except TimeoutError:
        return None, {"type": "http_error", "code": TIMED_OUT,
                      "message": f"the MCP server did not answer within {timeout_s:g} s"}
    except Exception as exc:  # noqa: BLE001 - whatever a server does, the session goes on
        cause = _leaf(exc)
        if isinstance(cause, httpx2.HTTPStatusError):
            return None, {"type": "http_error", "code": cause.response.status_code,
                          "message": f"the MCP server answered HTTP "
                                     f"{cause.response.status_code}"}
        if isinstance(cause, (httpx2.TransportError, OSError)):
            return None, {"type": "http_error", "code": UNREACHABLE,
                          "message": f"cannot reach the MCP server: {cause}"}
        if isinstance(cause, MCPError):
            return None, {"type": "protocol_error", "code": cause.error.code,
                          "message": cause.error.message}
        return None, {"type": "protocol_error", "code": -32603,
                      "message": f"{type(cause).__name__}: {cause}"}


def _leaf(exc: BaseException) -> BaseException:
    """The first error inside the task groups the SDK's transports run in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _tool(tool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tool.name, "input_schema": tool.input_schema}
    if tool.description:
        out["description"] = tool.description
    if tool.annotations is not None:
        out["annotations"] = tool.annotations.model_dump(by_alias=True, exclude_none=True)
    return out


def _text(result) -> str:
    """A call's content as the model reads it: its text parts, else its structured content."""
    texts = [part.text for part in result.content if getattr(part, "type", None) == "text"]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content)
    return ""
