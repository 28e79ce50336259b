"""The engine's start prepares the decode steps' buckets (`DuplexModel.warm_up`, where a GPU
captures its CUDA graphs), says so in its startup report, and counts how each step ran: here
the fixed buffers a graph would replay (`static_steps`), on the CPU."""

import threading

from duplex.engine import Engine, EngineConfig, ResponseFinished
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.tiny import load_preprocessor
from models.reply import ReplySpec

OPTIONS = Qwen3OmniOptions(min_text_tokens=3, max_text_tokens=6, min_frames=2, max_frames=6)


def test_the_start_prepares_every_bucket_and_the_steps_run_from_them(tiny_omni_dir):
    loaded = Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)
    model = Qwen3OmniAdapter(loaded.model, loaded.tokenizer,
                             load_preprocessor(tiny_omni_dir, loaded.model.config),
                             options=OPTIONS, static_steps=True)
    engine = Engine(model, EngineConfig(max_sessions=3))
    startup = engine.model.startup
    # Three sessions at most: buckets of one, two and four rows, for each fixed-shape step.
    for stage in ("thinker", "talker", "code_predictor"):
        assert startup[f"{stage}_graphs"] == [1, 2, 4]
    assert startup["warnings"] == []
    done = {sid: threading.Event() for sid in "ab"}

    def deliver(sid):
        return lambda event: isinstance(event, ResponseFinished) and done[sid].set()

    engine.start()
    try:
        for sid in "ab":
            engine.open(sid, deliver(sid))
            engine.push_text(sid, "hello there")
        for sid in "ab":
            engine.commit(sid, 0, ReplySpec(temperature=0.0))
        for sid in "ab":
            assert done[sid].wait(60)
        assert engine.wait_idle()
        steps = engine.graph_stats
        for stage in ("thinker", "talker", "code_predictor"):
            assert steps[stage]["static"] > 0, steps
            assert steps[stage]["replays"] == steps[stage]["eager"] == 0, steps
    finally:
        engine.stop()
