"""The ceiling measurement on a model whose cost is known: each stage call advances a clock by
a fixed cost per call plus a cost per session, so the expected figures are exact."""

from __future__ import annotations

import numpy as np
import pytest

from duplex.bench import ceiling
from duplex.bench.run import measure_ceiling
from duplex.engine import Engine, EngineConfig
from models.base import DuplexModel, ModelState, TalkerFrame, ThinkerToken

# Seconds per call and per session in the call, by stage.
COST = {
    "encode": (0.004, 0.001),
    "prefill": (0.002, 0.0005),
    "thinker": (0.003, 0.0002),
    "talker": (0.005, 0.0004),
    "codec": (0.006, 0.0003),
}


class _Row:
    nbytes = 0

    def release(self) -> None:
        pass


class CostedModel(DuplexModel):
    """Replies of `reply_frames` frames whose every stage call costs COST on `self.now`; a
    reply's Thinker text ends after `reply_tokens` tokens. Records the batch of every call."""

    name = "costed"
    input_rate = 16000
    output_rate = 24000
    input_chunk_samples = 1600
    frame_samples = 1920

    def __init__(self, reply_tokens: int = 3, reply_frames: int = 4) -> None:
        self.now = 0.0
        self.calls: dict[str, list[int]] = {stage: [] for stage in COST}
        self.reply_tokens, self.reply_frames = reply_tokens, reply_frames
        self.live: dict[str, list[int]] = {}

    def _spend(self, stage: str, n: int) -> None:
        fixed, per_session = COST[stage]
        self.now += fixed + per_session * n
        self.calls[stage].append(n)

    def new_state(self, session_id: str) -> ModelState:
        return ModelState(session_id, {"row": _Row()})

    def reset_response(self, state: ModelState) -> None:
        self.live.pop(state.session_id, None)

    def free(self, state: ModelState) -> None:
        self.live.pop(state.session_id, None)
        super().free(state)

    def begin_response(self, state: ModelState, spec=None) -> None:
        self.live[state.session_id] = [0, 0]

    def encode_audio(self, states, chunks):
        assert all(len(c) == self.input_chunk_samples for c in chunks)
        self._spend("encode", len(states))
        return [np.zeros(4, np.float32) for _ in chunks]

    def thinker_prefill(self, states, features) -> None:
        self._spend("prefill", len(states))

    def thinker_decode(self, states):
        self._spend("thinker", len(states))
        out = []
        for s in states:
            reply = self.live[s.session_id]
            reply[0] += 1
            out.append(ThinkerToken("a", None, reply[0] >= self.reply_tokens))
        return out

    def talker_step(self, states, tokens):
        self._spend("talker", len(states))
        out = []
        for s in states:
            reply = self.live[s.session_id]
            reply[1] += 1
            out.append(TalkerFrame(np.full(2, reply[1]), reply[1] >= self.reply_frames))
        return out

    def codec_decode(self, states, codes):
        assert all(c is not None for c in codes)
        self._spend("codec", len(states))
        return [np.zeros(self.frame_samples, np.float32) for _ in states]


def _expected_ms(stage: str, batch: int) -> float:
    fixed, per_session = COST[stage]
    return (fixed + per_session * batch) * 1000


def test_each_stage_is_timed_alone_at_the_batch_size_asked():
    model = CostedModel()
    batches = {"encode": 3, "prefill": 2, "thinker": 5, "talker": 4, "codec": 6}
    measured = ceiling.measure(model, batches, repeats=20, warmup=2, clock=lambda: model.now)
    assert measured["frame_ms"] == pytest.approx(80.0)
    for stage, batch in batches.items():
        assert measured["ms_per_call"][stage] == pytest.approx(_expected_ms(stage, batch))
    # Timed calls hold exactly the batch asked; the rest feed the reply stages their inputs.
    assert model.calls["encode"].count(3) >= 22
    assert model.calls["thinker"].count(5) >= 22
    assert model.calls["codec"] == [6] * 22 * ceiling.ROUNDS


class SlowSpellModel(CostedModel):
    """Its first `slow_calls` stage calls cost three times as much: the machine was busy."""

    def __init__(self, slow_calls: int) -> None:
        super().__init__()
        self.slow_calls = slow_calls

    def _spend(self, stage: str, n: int) -> None:
        before = self.now
        super()._spend(stage, n)
        if self.slow_calls > 0:
            self.slow_calls -= 1
            self.now += 2 * (self.now - before)


def test_a_slow_spell_of_the_machine_moves_no_stage_s_figure():
    batches = {"encode": 3, "codec": 6}
    # The spell lasts the whole first round of the first stage measured.
    spell = ceiling.WARMUP + ceiling.REPEATS
    model = SlowSpellModel(spell)
    measured = ceiling.measure(model, batches, clock=lambda: model.now)
    for stage, batch in batches.items():
        assert measured["ms_per_call"][stage] == pytest.approx(_expected_ms(stage, batch))
    # Measured one stage after the other instead, encode takes every slow call.
    model = SlowSpellModel(spell)
    measured = ceiling.measure(model, batches, rounds=1, clock=lambda: model.now)
    assert measured["ms_per_call"]["encode"] == pytest.approx(3 * _expected_ms("encode", 3))


def test_rows_whose_reply_ended_start_another_so_every_timed_call_is_full():
    # Replies shorter than the repeats: rows end and restart all along.
    model = CostedModel(reply_tokens=2, reply_frames=3)
    measured = ceiling.measure(model, {"thinker": 4, "talker": 4, "codec": 4}, repeats=21,
                               clock=lambda: model.now)
    for stage in ("thinker", "talker", "codec"):
        assert measured["ms_per_call"][stage] == pytest.approx(_expected_ms(stage, 4))
    assert not model.live, "the measurement frees its sessions"


def test_only_stages_asked_for_are_measured():
    model = CostedModel()
    measured = ceiling.measure(model, {"codec": 2}, repeats=20, clock=lambda: model.now)
    assert set(measured["ms_per_call"]) == {"codec"}
    # Each round's codec sessions are given one chunk of input to reply to, untimed; nothing
    # more.
    assert model.calls["encode"] == model.calls["prefill"] == [2] * ceiling.ROUNDS


def test_loads_weigh_each_stage_by_its_items_per_reply_frame():
    stages = {
        "codec": {"mean_batch": 20.2, "items": 400},
        "talker": {"mean_batch": 19.6, "items": 410},
        "thinker": {"mean_batch": 7.4, "items": 200},
        "encode": {"mean_batch": 0.4, "items": 40},
        "vision": {"mean_batch": 1.0, "items": 3},
    }
    loads = ceiling.stage_loads(stages)
    assert loads == {
        "codec": ceiling.StageLoad(20, 1.0),
        "talker": ceiling.StageLoad(20, 1.025),
        "thinker": ceiling.StageLoad(7, 0.5),
        "encode": ceiling.StageLoad(1, 0.1),
    }
    assert ceiling.stage_loads({"encode": {"mean_batch": 1.0, "items": 5}}) == {}


def test_ceiling_is_the_frame_over_the_weighted_cost_per_session():
    loads = {"codec": ceiling.StageLoad(10, 1.0), "thinker": ceiling.StageLoad(4, 0.5)}
    measured = {"frame_ms": 80.0, "ms_per_call": {"codec": 20.0, "thinker": 8.0}}
    report = ceiling.ceiling(loads, measured)
    # codec 20/10 * 1 + thinker 8/4 * 0.5 = 3 ms per session frame.
    assert report["ceiling_ms_per_session_frame"] == pytest.approx(3.0)
    assert report["ceiling_sessions"] == pytest.approx(80 / 3, abs=0.01)
    assert report["ceiling_stages"]["thinker"] == {
        "batch": 4, "per_frame": 0.5, "ms_per_call": 8.0, "ms_per_session_frame": 1.0,
    }

    # Beside the engine's own calls: 300 ms of codec over 100 frames is 1.5x the ceiling's 2.
    engine = {"codec": {"items": 100, "total_ms": 300.0}, "thinker": {"items": 50, "total_ms": 90.0}}
    stages = ceiling.ceiling(loads, measured, engine)["ceiling_stages"]
    assert stages["codec"]["engine_ms_per_session_frame"] == 3.0
    assert stages["codec"]["engine_vs_ceiling"] == 1.5
    assert stages["thinker"]["engine_vs_ceiling"] == 0.9


def _stub_summary(stages):
    return {name: {"mean_batch": b, "items": items} for name, (b, items) in stages.items()}


def test_the_bench_measures_where_the_engine_keeps_the_model():
    model = CostedModel()
    engine = Engine(model, EngineConfig())
    engine.start()
    try:
        stages = _stub_summary({"codec": (3.0, 30), "talker": (3.0, 30), "thinker": (2.0, 20)})
        report = measure_ceiling(engine, stages)
    finally:
        engine.stop()
    # The engine thread's clock, not the fake one, timed this; only the batches are known.
    assert set(report["ceiling_stages"]) == {"codec", "talker", "thinker"}
    assert model.calls["codec"] and set(model.calls["codec"]) == {3}
    assert report["ceiling_ms_per_session_frame"] > 0
    assert report["ceiling_sessions"] == pytest.approx(
        80 / report["ceiling_ms_per_session_frame"], rel=1e-3)


def test_a_run_without_reply_frames_has_no_ceiling():
    assert measure_ceiling(None, _stub_summary({"encode": (1.0, 4)})) == {
        "ceiling_ms_per_session_frame": None, "ceiling_sessions": None, "ceiling_stages": {},
    }

