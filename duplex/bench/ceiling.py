"""The arithmetic ceiling: what one reply frame of one session costs the model alone.

The engine found a largest real-time session count and recorded, per stage, how many calls it
made and how many sessions they held. Here the same model, in the same process with the same
torch threads, runs each stage's batched call at the batch size the engine used (no scheduler,
no events, no other sessions) and times it: `rounds` rounds that take the stages in turn, each
`repeats` calls after a warm-up, and the median of all those calls. In rounds, a slow spell of
a shared machine (seen: the same call at the same batch size 1.7x slower in one run than in
the next) touches a little of every stage rather than all of one. A stage's
cost per session frame is its cost per call over the batch size, times how many of its items the
engine ran per reply frame (codec items: one per session frame). Their sum is the ceiling cost;
frame duration over it is how many sessions the arithmetic alone could voice at once.

Why the mean batch size: a stage call costs about a + b * batch, so the cost per item of calls
whose sizes vary is a / mean + b, which is the cost per item of a call of the mean size.

Runs where the model lives: `engine.query(partial(measure, batches=...))`. On a CUDA device a
call is timed by the device's own clock (events around it, `duplex.engine.timing`), waited for
after each call: a call returns once its work is queued, and a host clock would miss it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from duplex.bench.synth import babble
from duplex.engine.timing import StageClock
from models.base import DuplexModel, ModelState

REPEATS = 21
WARMUP = 3
ROUNDS = 5
STAGES = ("encode", "prefill", "thinker", "talker", "codec")
"""The stages measured; the bench sends no camera frames, so there is no vision stage."""


@dataclass(frozen=True)
class StageLoad:
    batch: int
    """Sessions per call, the engine's mean rounded (at least 1)."""
    per_frame: float
    """Items of this stage the engine ran per reply frame of one session."""


def stage_loads(stages: dict[str, dict[str, Any]]) -> dict[str, StageLoad]:
    """What each stage did per reply frame, from the engine's stage summary of one run
    (`EngineStats.summary()`); empty when no reply frame was decoded."""
    frames = stages.get("codec", {}).get("items", 0)
    if not frames:
        return {}
    return {
        name: StageLoad(max(1, round(s["mean_batch"])), s["items"] / frames)
        for name, s in stages.items()
        if name in STAGES and s.get("items")
    }


def measure(model: DuplexModel, batches: dict[str, int], repeats: int = REPEATS,
            warmup: int = WARMUP, rounds: int = ROUNDS,
            clock: Callable[[], float] = time.perf_counter) -> dict:
    """Median milliseconds of one call of each stage in `batches` at that batch size, and the
    model's frame duration: {"frame_ms": float, "ms_per_call": {stage: float}}. `clock`
    (seconds) times a model that is not on a CUDA device."""
    timer = StageClock(model.device, clock)
    samples: dict[str, list[float]] = {stage: [] for stage in STAGES if stage in batches}
    for _ in range(rounds):
        for stage, timed in samples.items():
            timed += _TIMERS[stage](model, batches[stage], warmup + repeats, timer)[warmup:]
    costs = {stage: statistics.median(timed) * 1000 for stage, timed in samples.items()}
    return {"frame_ms": model.frame_samples / model.output_rate * 1000, "ms_per_call": costs}


def ceiling(loads: dict[str, StageLoad], measured: dict,
            engine: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report's ceiling figures from the engine's loads and the model-alone costs. With
    the engine's stage summary, each stage also says what the engine's own calls cost per
    session frame and how many times the ceiling's that is: a stage whose cost does not hang
    on the sessions' histories (the codec, the encoder) far over 1 says the calls ran slower
    in the run than alone (a core shared with the sessions' loops), not that the engine added
    work to them."""
    stages = {
        name: {
            "batch": load.batch,
            "per_frame": round(load.per_frame, 4),
            "ms_per_call": measured["ms_per_call"][name],
            "ms_per_session_frame": measured["ms_per_call"][name] / load.batch * load.per_frame,
        }
        for name, load in loads.items()
    }
    frames = (engine or {}).get("codec", {}).get("items")
    for name, stage in stages.items():
        total = (engine or {}).get(name, {}).get("total_ms")
        if frames and total is not None:
            stage["engine_ms_per_session_frame"] = round(total / frames, 4)
            stage["engine_vs_ceiling"] = round(total / frames / stage["ms_per_session_frame"], 3)
    cost = sum(s["ms_per_session_frame"] for s in stages.values())
    return {
        "ceiling_ms_per_session_frame": cost or None,
        "ceiling_sessions": round(measured["frame_ms"] / cost, 2) if cost else None,
        "ceiling_stages": stages,
    }


# -- one stage at a time ------------------------------------------------------------------------


def _timed(timer: StageClock, fn, *args):
    """(fn's result, its seconds)."""
    ms: list[float] = []
    with timer.timed(ms):
        out = fn(*args)
    timer.collect(wait=True)
    return out, ms[0] / 1000


def _states(model: DuplexModel, tag: str, n: int) -> list[ModelState]:
    return [model.new_state(f"ceiling-{tag}-{i}") for i in range(n)]


def _chunks(model: DuplexModel, n: int, salt: int) -> list:
    return [babble(model.input_chunk_samples, model.input_rate, seed=salt * 1000 + i)
            for i in range(n)]


def _free(model: DuplexModel, states: list[ModelState]) -> None:
    for state in states:
        model.free(state)


def _encode(model, n, calls, timer) -> list[float]:
    states = _states(model, "encode", n)
    try:
        chunks = _chunks(model, n, 0)
        return [_timed(timer, model.encode_audio, states, chunks)[1] for _ in range(calls)]
    finally:
        _free(model, states)


def _prefill(model, n, calls, timer) -> list[float]:
    states = _states(model, "prefill", n)
    try:
        samples = []
        for k in range(calls):
            features = model.encode_audio(states, _chunks(model, n, k))
            samples.append(_timed(timer, model.thinker_prefill, states, features)[1])
        return samples
    finally:
        _free(model, states)


class _Replies:
    """`n` sessions kept in the middle of a reply, one frame further per `advance`: a row whose
    reply ended (its Thinker text for `thinker`, its Talker frames otherwise) starts another,
    so every timed call holds `n` live rows as the engine's calls at the maximum did."""

    def __init__(self, model: DuplexModel, stage: str, n: int) -> None:
        self.model, self.stage = model, stage
        self.states = _states(model, stage, n)
        model.thinker_prefill(self.states, model.encode_audio(self.states, _chunks(model, n, 0)))
        for state in self.states:
            model.begin_response(state)
        self.ended = [False] * n
        self.codes: list[Any] = [None] * n

    def advance(self, timer: StageClock) -> float:
        """One frame of every row; the seconds of this rig's stage call."""
        model = self.model
        for state, ended in zip(self.states, self.ended, strict=True):
            if ended:
                model.reset_response(state)
                model.begin_response(state)
        tokens, thinker_s = _timed(timer, model.thinker_decode, self.states)
        frames, talker_s = _timed(timer, model.talker_step, self.states, tokens)
        for i, frame in enumerate(frames):
            if frame.codes is not None:
                self.codes[i] = frame.codes
        ends = tokens if self.stage == "thinker" else frames
        self.ended = [x.finished for x in ends]
        if self.stage == "thinker":
            return thinker_s
        if self.stage == "talker":
            return talker_s
        # The codec's cost does not depend on the code values: a row still without codes of
        # its own decodes another row's.
        some = next((c for c in self.codes if c is not None), None)
        if some is None:
            raise RuntimeError("the Talker gave no codes to decode")
        codes = [c if c is not None else some for c in self.codes]
        return _timed(timer, model.codec_decode, self.states, codes)[1]

    def close(self) -> None:
        _free(self.model, self.states)


def _reply_stage(stage: str):
    def run(model, n, calls, timer) -> list[float]:
        rig = _Replies(model, stage, n)
        try:
            return [rig.advance(timer) for _ in range(calls)]
        finally:
            rig.close()

    return run


_TIMERS = {
    "encode": _encode,
    "prefill": _prefill,
    "thinker": _reply_stage("thinker"),
    "talker": _reply_stage("talker"),
    "codec": _reply_stage("codec"),
}
