"""`duplex serve` as a user runs it: a subprocess on a free port."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from tests.waiting import until


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_health_and_metrics_then_exits_zero(server_process, sig):
    server = server_process("--model", "echo")
    health = httpx.get(f"{server.url}/healthz").json()
    assert {k: health[k] for k in ("status", "version", "model", "active_sessions")} == {
        "status": "ok", "version": "0.1.0", "model": "echo", "active_sessions": 0,
    }
    metrics = httpx.get(f"{server.url}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "duplex_active_sessions 0.0" in metrics.text
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and "<title>duplex</title>" in page.text
    server.proc.send_signal(sig)
    assert server.proc.wait(timeout=20) == 0


def _engine_child(pid: int) -> int:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += (task / "children").read_text().split()
    for child in children:
        if b"duplex.engine.process" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError(f"no engine process among {children}")


@pytest.mark.slow
def test_health_turns_503_when_the_engine_process_dies(server_process):
    server = server_process("--model", "echo")
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    os.kill(_engine_child(server.proc.pid), signal.SIGKILL)
    health = until(lambda: (r := httpx.get(f"{server.url}/healthz")).status_code != 200 and r,
                   "/healthz no longer ok after the engine died")
    assert health.status_code == 503
    assert health.json()["status"] == "engine_down"
    # A new session is refused, told why.
    with connect(server.url.replace("http", "ws") + "/v1/realtime") as ws:
        error = json.loads(ws.recv(timeout=10))["error"]
    assert error["param"] == "engine.process" and "exited with code -9" in error["message"]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=20) == 0


@pytest.mark.slow
def test_health_says_full_while_the_engine_would_refuse_and_shows_the_kv_pools(
        server_process, tiny_omni_dir):
    env = {**os.environ, "DUPLEX_ENGINE__MAX_SESSIONS": "1"}
    server = server_process("--model", str(tiny_omni_dir), env=env)
    health = httpx.get(f"{server.url}/healthz")
    assert health.status_code == 200
    kv = health.json()["kv"]
    assert set(kv) == {"thinker", "talker"}
    assert kv["thinker"]["blocks_free"] == kv["thinker"]["blocks_total"] > 0
    assert kv["thinker"]["block_bytes"] == 64 * 768
    with connect(server.url.replace("http", "ws") + "/v1/realtime") as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        full = httpx.get(f"{server.url}/healthz")
        assert full.status_code == 503
        assert (full.json()["status"], full.json()["limit"]) == ("full", "engine.max_sessions")
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f'duplex_kv_blocks_total{{stage="thinker"}} {kv["thinker"]["blocks_total"]}.0' \
            in metrics
        assert 'duplex_kv_block_bytes{stage="talker"} 16384.0' in metrics
    until(lambda: httpx.get(f"{server.url}/healthz").status_code == 200,
          "/healthz ok again once the session closed")


def test_bad_config_stops_startup_naming_key_and_file(tmp_path):
    cfg = tmp_path / "typo.toml"
    cfg.write_text("[modle]\nname = 'echo'\n")
    result = subprocess.run(
        [sys.executable, "-m", "duplex.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"{cfg}: unknown key 'modle'" in result.stderr


def test_a_missing_checkpoint_stops_startup_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "duplex.cli", "serve", "--model", str(tmp_path / "nowhere"),
         "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f"duplex: cannot load the model: no model checkpoint at {tmp_path / 'nowhere'} "
        "(config.json missing)\n"
    )


@pytest.mark.slow
async def test_sigterm_closes_open_sessions_then_exits_zero(server_process):
    import asyncio
    import json

    import websockets

    server = server_process("--model", "echo")
    url = server.url.replace("http", "ws") + "/v1/realtime"
    async with websockets.connect(url) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created"
        assert httpx.get(f"{server.url}/healthz").json()["active_sessions"] == 1
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        assert closed.value.rcvd.code == 1001
    assert server.proc.wait(timeout=20) == 0
