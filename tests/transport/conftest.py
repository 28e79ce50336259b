"""What a server holds for its sessions, read from outside: for tests that end sessions in
every way a connection can end and then check that nothing was kept."""

import os
import re

import httpx
import pytest

from tests.waiting import eventually

# What a traceback leaves in the server's log, whoever printed it: uvicorn, asyncio or logging.
TRACEBACK_MARKS = ("Traceback", "Exception in ASGI application", "exception was never retrieved")


def udp_sockets(pid: int) -> int:
    """UDP sockets the process holds open (each ICE candidate of a live peer connection)."""
    inodes = set()
    for name in ("udp", "udp6"):
        with open(f"/proc/{pid}/net/{name}") as table:
            inodes |= {line.split()[9] for line in list(table)[1:]}
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        held += target.startswith("socket:[") and target[8:-1] in inodes
    return held


async def holdings(server) -> dict[str, int]:
    """Sessions in the hub, bytes the engine holds for sessions, UDP sockets of the server."""
    async with httpx.AsyncClient(timeout=5) as client:
        health = (await client.get(f"{server.url}/healthz")).json()
        metrics = (await client.get(f"{server.url}/metrics")).text
    held = re.search(r"^duplex_engine_bytes_held (\S+)$", metrics, re.M)
    return {"active_sessions": health["active_sessions"], "bytes_held": int(float(held[1])),
            "udp_sockets": udp_sockets(server.proc.pid)}


def tracebacks(server) -> list[str]:
    """Each traceback in the server's log, with the lines around it."""
    lines = list(server.lines)
    return ["".join(lines[max(0, i - 2):i + 30]) for i, line in enumerate(lines)
            if any(mark in line for mark in TRACEBACK_MARKS)]


async def wait_released(server, udp_baseline: int = 0, timeout_s: float = 20.0) -> None:
    """Wait until the server holds nothing for any session (no hub entry, no engine bytes, no
    more UDP sockets than `udp_baseline`), and check that no traceback reached its log."""
    want = {"active_sessions": 0, "bytes_held": 0, "udp_sockets": udp_baseline}
    async def released() -> bool:
        return await holdings(server) == want

    if not await eventually(released, None, timeout_s):
        raise AssertionError(f"still held after {timeout_s} s: {await holdings(server)}")
    found = tracebacks(server)
    assert not found, f"{len(found)} tracebacks in the server's log; the first:\n{found[0]}"


@pytest.fixture(name="wait_released")
def wait_released_fixture():
    return wait_released


@pytest.fixture(name="holdings")
def holdings_fixture():
    return holdings
