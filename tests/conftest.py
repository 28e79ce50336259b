import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from filelock import FileLock

from tests.builds import built_once
from tests.waiting import until

LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Workers outnumber the cores: a torch pool of a thread per core in each would only
        # make them wait on each other's threads.
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(wrapper=True, tryfirst=True)  # around pytest-timeout's: the wait is no test's
def pytest_runtest_protocol(item, nextitem):
    """Tests marked cpu_bound or timing run one at a time across the xdist workers: a test that
    times what a listener hears never has a cpu_bound one beside it, and cpu_bound ones take
    one core at most. The lock is in the folder the run's workers share (their --basetemp's
    parent), and is held from the test's setup (its module's fixtures included) to its
    teardown."""
    exclusive = any(item.get_closest_marker(name) for name in ("cpu_bound", "timing"))
    if not exclusive or not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    with FileLock(Path(item.config.option.basetemp).parent / "cpu-bound.lock"):
        return (yield)


def free_port() -> int:
    """For servers that cannot bind port 0 and say which they got (redis-server: port 0 turns
    its TCP listener off)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`duplex serve` on a port the system picks (port 0); `url` once it says which."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port: int | None = None
        self.url = ""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "duplex.cli", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        # Drained all the time: a server whose log fills the pipe would block on its next line.
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append(line)

    def output(self) -> str:
        """Everything the server has logged so far (all of it once it has stopped)."""
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        until(self._ready, "the server answers /healthz", timeout_s)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            self._reader.join(timeout=5)
            raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
        if self.port is None:
            found = LISTENING.search(self.output())
            if found is None:
                return False
            self.port = int(found.group(1))
            self.url = f"http://127.0.0.1:{self.port}"
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)


@pytest.fixture
def server_process():
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(list(args), env)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def tiny_omni_dir(tmp_path_factory):
    """The tiny Qwen3-Omni checkpoint, built once per run the way `duplex models build` does."""
    from models.registry import build_tiny

    return built_once(tmp_path_factory, "tiny-omni", lambda folder: build_tiny("tiny-omni", folder))


class RedisServer:
    """A real redis-server on a free loopback port, nothing persisted; restartable in place."""

    def __init__(self, tmp_dir) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tmp_dir
        self.proc: subprocess.Popen | None = None
        self.started = False

    def start(self) -> None:
        """Started on its port; the first start moves to another port where the one the OS
        gave went to another process (another xdist worker's server) before redis bound it.
        A restart keeps its port, as a restarted redis keeps its address."""
        for _ in range(5):
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.dir)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            until(lambda: self.proc.poll() is not None or self._answers(),
                  "redis-server answers or exits")
            if self.proc.poll() is None or self.started:
                break
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
        assert self.proc.poll() is None, f"redis-server exited {self.proc.returncode}"
        self.started = True

    def _answers(self) -> bool:
        """This process's redis answers (not another one holding the port)."""
        import redis

        try:
            with redis.Redis(port=self.port, socket_timeout=0.5) as client:
                return client.info("server")["process_id"] == self.proc.pid
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server(tmp_path):
    import shutil

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make test installs it with apt-get)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_moshi_dir(tmp_path_factory):
    from models.registry import build_tiny

    return built_once(tmp_path_factory, "tiny-moshi",
                      lambda folder: build_tiny("tiny-moshi", folder))


class McpServers:
    """A real MCP server (the SDK's own `MCPServer`) on two loopback ports, one per transport:
    streamable HTTP at `http_url`, SSE at `sse_url`; `authorizations` holds the Authorization
    header of every request either got."""

    def __init__(self) -> None:
        import anyio
        from mcp.server.mcpserver import MCPServer

        server = MCPServer("duplex-tests", log_level="WARNING")

        @server.tool()
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @server.tool()
        def shout(text: str) -> str:
            """The text in capitals."""
            return text.upper()

        @server.tool()
        def fail() -> str:
            """Always fails."""
            raise ValueError("the tool failed on purpose")

        @server.tool()
        async def stall() -> str:
            """Answers after an hour."""
            await anyio.sleep(3600)
            return "late"

        self.authorizations: list[str] = []
        self._servers = []
        self.http_url = f"http://127.0.0.1:{self._serve(server.streamable_http_app())}/mcp"
        self.sse_url = f"http://127.0.0.1:{self._serve(server.sse_app())}/sse"

    def _serve(self, app) -> int:
        import uvicorn

        async def recording(scope, receive, send):
            if scope["type"] == "http":
                self.authorizations += [v.decode() for k, v in scope["headers"]
                                        if k == b"authorization"]
            await app(scope, receive, send)

        server = uvicorn.Server(uvicorn.Config(recording, host="127.0.0.1", port=0,
                                               log_level="warning", lifespan="on"))
        threading.Thread(target=server.run, daemon=True).start()
        until(lambda: server.started, "the MCP server listens")
        self._servers.append(server)
        return server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        for server in self._servers:
            server.should_exit = True


@pytest.fixture(scope="session")
def mcp_servers():
    servers = McpServers()
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def smart_turn_path():
    """Smart Turn v3.2's graph in the model cache dir (.models), fetched there on first use
    as `duplex models build smart-turn` and `duplex serve` do."""
    from duplex.config import load_settings
    from duplex.smart_turn import fetch

    return fetch(load_settings(None).model.cache_dir)
