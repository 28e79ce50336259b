"""Phase 3: what each stage call costs at batch 1 to 128, Qwen3-Omni-30B-A3B's shape at full
depth (the tiny model on the CPU), through the adapter the engine serves.

First the CUDA graphs, as the engine's start captures them (`warm_up`): the Thinker's and
Talker's decode steps and the code predictor's frame, every bucket up to the largest batch,
largest first, each bucket's capture time and the memory they took; then, per bucket, one step
replayed against the same step launched kernel by kernel from the same buffers (all rows
padding, a context of one position: the host's cost, not attention's). On the CPU nothing is
captured: the buffers run without a graph and only that time is given.

Then per batch size: that many sessions each take a second of audio per prefill, then open a
reply and step it: encode_audio, thinker_prefill, thinker_decode, talker_step and codec_decode,
each timed `repeats` times (the medians are the figures), then once more counting what made the
host wait for the device. Decode steps replay the graphs captured above (their count is a
figure). A reply's first step (the Talker's prefill) is not timed. Memory: the weights, what a
session holds at that point (its KV rows and codec state), and the peak.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import numpy as np
import torch

from duplex.gpucheck import build
from duplex.gpucheck.measure import (
    Clock,
    Timings,
    counting_syncs,
    is_cuda,
    memory,
    parameter_bytes,
    reset_peak,
)
from duplex.gpucheck.profile import Profile
from duplex.gpucheck.record import PhaseRecord
from models.qwen3_omni.adapter import Qwen3OmniOptions
from models.qwen3_omni.compat import thinker_parts

STAGES = ("encode_audio", "thinker_prefill", "thinker_decode", "talker_step", "codec_decode")

REPLY = Qwen3OmniOptions(min_text_tokens=64, max_text_tokens=64, min_frames=64)
"""Replies that outlast the timed steps: random weights would end them at once."""


def run(profile: Profile, record: PhaseRecord) -> None:
    device = profile.device
    started = time.perf_counter()
    model = build.model(profile, getattr(torch, profile.dtype), None)
    if is_cuda(device):
        torch.cuda.synchronize()
    record.set("model", f"{profile.bench_model} in {profile.dtype} on {device}")
    record.set("build s", round(time.perf_counter() - started, 1))
    record.set("weights GiB", round(parameter_bytes(model) / 2**30, 3))
    text = thinker_parts(model).text
    record.set("thinker experts implementation",
               str(getattr(text.config, "_experts_implementation", "unknown")))
    adapter = build.adapter(model, profile, REPLY, graphs=True)
    clock = Clock(device)
    record.attempt("graphs", lambda: graphs(record, profile, adapter, clock))
    for batch in profile.batches:
        record.attempt(f"B={batch}", lambda batch=batch: one_batch(record, profile, adapter,
                                                                   clock, batch))


@torch.inference_mode()
def graphs(record: PhaseRecord, profile: Profile, adapter, clock: Clock) -> None:
    """Capture as the engine's start does; then per bucket a step replayed against the same
    step launched from its buffers without the graph."""
    started = time.perf_counter()
    report = adapter.warm_up(max(profile.batches))
    record.set("graphs warm-up s", round(time.perf_counter() - started, 2))
    record.set("graph memory MiB", report.get("graph_memory_mib", "needs CUDA"))
    for warning in report["warnings"]:
        record.set("graphs warning", warning)
    for name, runner in adapter.graph_runners().items():
        record.set(f"{name} buckets", ", ".join(map(str, runner.ready)) or "none")
        record.update({f"{name} graph capture ms (B={size})": ms
                       for size, ms in sorted(runner.capture_ms.items())})
        for size in runner.ready:
            # No session has run yet: every row of the buffers is padding.
            static = runner.static(size)
            eager = Timings()
            for _ in range(profile.repeats):
                clock.time(static.run, eager)
            figures = {f"{name} step eager ms (B={size})": eager.medians()["wall ms"]}
            if runner.capture:
                replay = Timings()
                for _ in range(profile.repeats):
                    clock.time(partial(runner.run, size), replay)
                figures[f"{name} step replay ms (B={size})"] = replay.medians()["wall ms"]
            record.update(figures)


def one_batch(record: PhaseRecord, profile: Profile, adapter, clock: Clock, batch: int) -> None:
    device = profile.device
    reset_peak(device)
    timings = {stage: Timings() for stage in STAGES}
    syncs = {}
    states = [adapter.new_state(f"b{batch}-{i}") for i in range(batch)]
    rng = np.random.default_rng(batch)

    def audio() -> list[np.ndarray]:
        return [(0.1 * rng.standard_normal(adapter.input_chunk_samples)).astype(np.float32)
                for _ in states]

    def prefill(time_it) -> None:
        chunks = audio()
        feats = time_it("encode_audio", lambda: adapter.encode_audio(states, chunks))
        time_it("thinker_prefill", lambda: adapter.thinker_prefill(states, feats))

    def step(time_it) -> None:
        tokens = time_it("thinker_decode", lambda: adapter.thinker_decode(states))
        frames = time_it("talker_step", lambda: adapter.talker_step(states, tokens))
        codes = [frame.codes for frame in frames]
        if any(c is None for c in codes):
            raise RuntimeError("a reply ended inside the timed steps")
        time_it("codec_decode", lambda: adapter.codec_decode(states, codes))

    def timed(stage, call):
        return clock.time(call, timings[stage])

    def counted(stage, call):
        with counting_syncs(device) as count:
            result = call()
        syncs[stage] = count
        return result

    def untimed(stage, call):
        return call()

    for _ in range(profile.repeats):
        prefill(timed)
    prefill(counted)
    for state in states:
        adapter.begin_response(state)
    step(untimed)
    before = adapter.graph_stats()
    for _ in range(profile.repeats):
        step(timed)
    step(counted)
    after = adapter.graph_stats()
    how = {stage: ", ".join(f"{path} {after[stage][path] - before[stage][path]}"
                            for path in after[stage] if after[stage][path] > before[stage][path])
           for stage in after}
    held = statistics.mean(adapter.bytes_held(state) for state in states)
    used = memory(device)
    for state in states:
        adapter.free(state)
    figures = {}
    for stage in STAGES:
        for name, value in timings[stage].medians().items():
            if value is not None:
                figures[f"B={batch} {stage} {name}"] = value
        figures[f"B={batch} {stage} syncs (dispatch count)"] = syncs[stage].counted
        if syncs[stage].warned is not None:
            figures[f"B={batch} {stage} syncs (sync debug mode)"] = syncs[stage].warned
    figures[f"B={batch} state MiB per session (KV rows, codec state)"] = round(held / 2**20, 3)
    figures.update({f"B={batch} {stage} steps ran as": ran or "none"
                    for stage, ran in how.items()})
    figures.update({f"B={batch} {name}": value for name, value in used.items()})
    record.update(figures)
