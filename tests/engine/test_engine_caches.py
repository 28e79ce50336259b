"""The model's caches behind the engine: counters reach its callers (and /metrics) through the
core's report, and closing sessions frees their own state while the caches keep theirs."""

import threading

import numpy as np

from duplex.engine import Engine, EngineConfig, ResponseFinished
from duplex.observability.metrics import Metrics
from models.caches import FEATURE, PREFIX
from models.registry import load_model
from models.reply import ReplySpec

PROMPT = "You answer questions about timetables. " * 8


def test_sessions_that_start_alike_share_the_prefix_and_a_repeated_image(tiny_omni_dir):
    model = load_model(str(tiny_omni_dir))
    engine = Engine(model, EngineConfig(max_sessions=2))
    engine.start()
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    spec = ReplySpec(audio=False, max_output_tokens=4, instructions=PROMPT)
    try:
        for sid in ("first", "second"):
            done = threading.Event()
            engine.open(sid, lambda e, done=done: done.set()
                        if isinstance(e, ResponseFinished) else None)
            engine.instruct(sid, PROMPT, ())
            assert engine.push_frame(sid, image)
            assert engine.push_text(sid, "which platform")
            engine.commit(sid, 0, spec)
            assert done.wait(60)
        assert engine.wait_idle()
        prefix, feature = engine.cache_stats[PREFIX], engine.cache_stats[FEATURE]
        assert (prefix.hits, prefix.misses, prefix.entries) == (1, 1, 1)
        assert (feature.hits, feature.misses, feature.entries) == (1, 1, 1)
        metrics = Metrics(model.name)
        metrics.sync_engine(engine)
        text = metrics.render().decode()
        assert "duplex_prefix_cache_hits_total 1.0" in text
        assert "duplex_feature_cache_hits_total 1.0" in text
        assert f"duplex_prefix_cache_bytes {float(prefix.bytes)}" in text

        for sid in ("first", "second"):
            engine.close(sid)
        assert engine.wait_idle()
        assert engine.bytes_held("first") == engine.bytes_held("second") == 0
        # What the caches hold is theirs, kept for the next session, never a session's.
        assert engine.cache_stats[PREFIX].bytes == prefix.bytes > 0
        assert engine.cache_stats[FEATURE].bytes == feature.bytes > 0
    finally:
        engine.stop()
