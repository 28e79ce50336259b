"""The official openai SDK as a client of `duplex serve`: what the SDK tests share."""

import asyncio

from openai import AsyncOpenAI


def client_for(server) -> AsyncOpenAI:
    """An SDK client of `server` (tests/conftest.py ServerProcess), with its test key."""
    return AsyncOpenAI(api_key="sk-test", base_url=f"{server.url}/v1",
                       websocket_base_url=server.url.replace("http", "ws") + "/v1")


async def events_until(conn, stop_type: str, timeout: float = 60.0) -> list:
    """Every event the connection yields up to and including the first of `stop_type`."""
    events = []

    async def run():
        async for event in conn:
            events.append(event)
            if event.type == stop_type:
                return

    await asyncio.wait_for(run(), timeout)
    return events
