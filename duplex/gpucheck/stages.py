"""Phase 3: what each stage call costs at batch 1 to 128, Qwen3-Omni-30B-A3B's shape at full
depth (the tiny model on the CPU), through the adapter the engine serves.

Per batch size: that many sessions each take a second of audio per prefill, then open a reply
and step it: encode_audio, thinker_prefill, thinker_decode, talker_step and codec_decode, each
timed `repeats` times (the medians are the figures), then once more counting what made the
host wait for the device. A reply's first step (the Talker's prefill and, on a GPU, the capture
of the code predictor's graph for that batch's bucket) is not timed. Memory: the weights, what
a session holds at that point (its KV rows and codec state), and the peak.
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
from models.qwen3_omni.graphs import BUCKETS, residual_graphs
from models.qwen3_omni.options import Stream

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
    record.attempt("graph capture", lambda: capture(record, profile, model))
    adapter = build.adapter(model, profile, REPLY, cuda_graphs=True)
    clock = Clock(device)
    for batch in profile.batches:
        record.attempt(f"B={batch}", lambda batch=batch: one_batch(record, profile, adapter,
                                                                   clock, batch))


@torch.inference_mode()
def capture(record: PhaseRecord, profile: Profile, model) -> None:
    """The code predictor's graph for every bucket, captured apart from the adapter's: the
    first call captures and replays, the second replays."""
    talker, device = model.talker, profile.device
    predictor = talker.code_predictor
    dtype = next(predictor.parameters()).dtype
    runner = residual_graphs(predictor, talker.get_input_embeddings(),
                             model.config.talker_config.num_code_groups,
                             Qwen3OmniOptions().residual_sampling, device, dtype, enabled=True)
    if runner is None:
        record.set("graph capture", "needs CUDA")
        return
    clock = Clock(device)
    for size in BUCKETS:
        hidden = torch.randn(size, predictor.config.hidden_size, device=device, dtype=dtype)
        first = torch.randint(0, predictor.config.vocab_size, (size,), device=device)
        first_call, replay = Timings(), Timings()
        call = partial(runner, hidden, first, [Stream(i) for i in range(size)])
        for timings in (first_call, replay):
            codes = clock.time(call, timings)
            if codes is None:
                raise RuntimeError(f"capture failed at batch {size} (see the log)")
        record.set(f"graph capture + first replay ms (B={size})",
                   round(first_call.wall_ms[0], 1))
        record.set(f"graph replay ms (B={size})", round(replay.wall_ms[0], 3))


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
    for _ in range(profile.repeats):
        step(timed)
    step(counted)
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
    figures.update({f"B={batch} {name}": value for name, value in used.items()})
    record.update(figures)
