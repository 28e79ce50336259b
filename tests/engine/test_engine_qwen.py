"""The engine with the tiny Qwen3-Omni: camera frames and audio of two sessions, batched."""

import threading

import numpy as np
import pytest

from duplex.engine import AudioOut, Engine, EngineConfig, ResponseFinished, SchedulerConfig
from models.registry import load_model


@pytest.mark.slow
def test_video_and_audio_of_two_sessions_share_forwards_and_get_replies(tiny_omni_dir):
    model = load_model(str(tiny_omni_dir))
    # A long encoder wait keeps the test independent of how fast this thread pushes.
    scheduler = SchedulerConfig(encode_wait_s=0.5, output_rate=model.output_rate)
    engine = Engine(model, EngineConfig(max_sessions=4, scheduler=scheduler))
    # Checked before serving: both MoE parts on grouped_mm, nothing slow to warn of.
    assert engine.model.startup == {
        "experts": {"talker": "grouped_mm", "thinker": "grouped_mm"}, "warnings": []}
    engine.start()
    try:
        done = {sid: threading.Event() for sid in "ab"}
        audio = {sid: [] for sid in "ab"}

        def deliver(event):
            if isinstance(event, AudioOut):
                audio[event.session_id].append(event.pcm)
            elif isinstance(event, ResponseFinished):
                done[event.session_id].set()

        rng = np.random.default_rng(0)
        for sid in "ab":
            engine.open(sid, deliver)
        engine.wait_idle()
        for sid in "ab":
            assert engine.push_frame(sid, rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
            engine.push_audio(sid, rng.uniform(-0.3, 0.3, 16000).astype(np.float32))
        for sid in "ab":
            engine.commit(sid, 0)
        for sid in "ab":
            assert done[sid].wait(60)
            assert sum(len(p) for p in audio[sid]) >= 25 * model.frame_samples
        assert max(engine.stats.stages["vision"].batch_sizes) == 2
        assert max(engine.stats.stages["talker"].batch_sizes) == 2
        for sid in "ab":
            engine.close(sid)
        engine.wait_idle()
        assert engine.bytes_held("a") == engine.bytes_held("b") == 0
    finally:
        engine.stop()


@pytest.mark.slow
def test_text_input_gets_a_spoken_reply(tiny_omni_dir):
    model = load_model(str(tiny_omni_dir))
    engine = Engine(model, EngineConfig(max_sessions=2))
    engine.start()
    try:
        done = threading.Event()
        audio = []

        def deliver(event):
            if isinstance(event, AudioOut):
                audio.append(event.pcm)
            elif isinstance(event, ResponseFinished):
                done.set()

        engine.open("t", deliver)
        assert engine.push_text("t", "hello there")
        engine.commit("t", 0)
        assert done.wait(60)
        assert sum(len(p) for p in audio) >= 25 * model.frame_samples
    finally:
        engine.stop()
