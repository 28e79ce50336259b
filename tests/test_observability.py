"""Prometheus figures fed from the engine and the session edge; JSON logs with session context."""

import asyncio
import base64
import contextvars
import json
import logging
import os
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import websockets

from duplex.engine.scheduler import Drop
from duplex.engine.stats import EngineStats
from duplex.observability.logs import JsonFormatter, SessionContext, bind_session
from duplex.observability.metrics import Metrics
from models.caches import CacheStats
from tests.waiting import eventually


def test_engine_stats_become_histograms_and_are_drained():
    stats = EngineStats()
    stats.stages["thinker"].queue_ms += [1.0, 30.0]
    stats.stages["thinker"].compute_ms += [2.0]
    stats.stages["thinker"].batch_sizes += [4]
    drops = [Drop("s1", "pcm", 3, 12, "stale_epoch")]
    engine = SimpleNamespace(stats=stats, total_bytes_held=lambda: 4096,
                             drain_drops=lambda: [drops.pop()] if drops else [],
                             cache_stats={"prefix": CacheStats(hits=3, misses=1, bytes=512)},
                             graph_stats={"thinker": {"replays": 40, "static": 0, "eager": 2}})
    metrics = Metrics("echo")
    metrics.sync_engine(engine)
    metrics.sync_engine(engine)
    text = metrics.render().decode()
    assert 'duplex_stage_queue_seconds_count{stage="thinker"} 2.0' in text
    assert 'duplex_stage_queue_seconds_bucket{le="0.025",stage="thinker"} 1.0' in text
    assert 'duplex_stage_compute_seconds_sum{stage="thinker"} 0.002' in text
    assert 'duplex_stage_batch_size_count{stage="thinker"} 1.0' in text
    assert 'duplex_dropped_total{kind="pcm",reason="stale_epoch"} 3.0' in text
    assert "duplex_engine_bytes_held 4096.0" in text
    assert "duplex_prefix_cache_hits_total 3.0" in text
    assert "duplex_prefix_cache_misses_total 1.0" in text
    assert "duplex_prefix_cache_bytes 512.0" in text
    # A cache the model does not keep reads zero rather than missing from the page.
    assert "duplex_feature_cache_hits_total 0.0" in text
    assert 'duplex_model_steps_total{path="replays",stage="thinker"} 40.0' in text
    assert 'duplex_model_steps_total{path="eager",stage="thinker"} 2.0' in text
    assert stats.stages["thinker"].queue_ms == []


def test_json_log_lines_carry_session_and_epoch():
    record_ = logging.LogRecord("duplex.x", logging.INFO, __file__, 1, "hello %s", ("you",), None)

    def in_session():
        bind_session("sess_1", 3)
        SessionContext().filter(record_)

    contextvars.copy_context().run(in_session)
    line = json.loads(JsonFormatter().format(record_))
    assert line["message"] == "hello you" and line["level"] == "info"
    assert (line["session_id"], line["epoch"]) == ("sess_1", 3)
    outside = logging.LogRecord("duplex.x", logging.INFO, __file__, 1, "plain", (), None)
    SessionContext().filter(outside)
    assert "session_id" not in json.loads(JsonFormatter().format(outside))


@pytest.mark.slow
async def test_server_reports_ttfa_drops_and_logs_json(server_process):
    env = {**os.environ, "DUPLEX_SERVER__LOG_FORMAT": "json"}
    server = server_process("--model", "echo", env=env)
    url = server.url.replace("http", "ws") + "/v1/realtime"
    audio = (np.random.default_rng(0).uniform(-0.2, 0.2, 24000 // 2) * 32767).astype("<i2")
    async with websockets.connect(url) as ws:
        session_id = json.loads(await ws.recv())["session"]["id"]
        await ws.send(json.dumps({"type": "session.update",
                                  "session": {"audio": {"input": {"turn_detection": None}}}}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(audio.tobytes()).decode()}))
        # Six seconds at once is far ahead of real time: refused and counted as a drop.
        burst = np.zeros(24000 * 6, "<i2").tobytes()
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(burst).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        while json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] != "response.done":
            pass
    def metrics_with_ttfa() -> str:
        text = httpx.get(f"{server.url}/metrics").text
        return text if "duplex_ttfa_seconds_count 1.0" in text else ""

    text = await eventually(metrics_with_ttfa, "the reply's TTFA reaches /metrics")
    assert 'duplex_dropped_total{kind="input_audio",reason="faster_than_real_time"} 144000.0' in text
    assert 'duplex_stage_compute_seconds_count{stage="' in text
    server.stop()
    lines = [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    closed = [entry for entry in lines if entry["message"].startswith("session ")
              and "closed" in entry["message"]]
    assert closed and closed[0]["session_id"] == session_id and closed[0]["epoch"] == 1

