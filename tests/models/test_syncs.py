"""What would make a GPU wait for the host, counted on the CPU (`models.syncs`): the counter
sees what it should, and each Qwen3-Omni stage call at batch 8 reads from the device at most
once (sampled tokens, codes, PCM), on the eager path and with the decode steps loaded into the
fixed buffers a CUDA graph replays (`static_steps`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.tiny import load_preprocessor
from models.syncs import SyncCounter, fetch, on_host, upload

BATCH = 8


def test_the_counter_tells_device_reads_from_host_work():
    weight = torch.nn.Linear(4, 4).weight
    with SyncCounter() as counter:
        host = torch.arange(6)
        assert host.tolist() == list(range(6)) and bool(host.any())
        device = weight @ torch.ones(4, device=weight.device)
        weight @ torch.ones(4)
        device.sum().item()
        device.tolist()
        device[device > 0]
        device.masked_fill(device > 0, 0.0)
        torch.tensor([1, 2], device=weight.device)
        device[torch.tensor([0, 1])]
        moved = upload([0, 1], weight.device)
        device[moved]
        fetch(device)
    kinds = [s.kind for s in counter.syncs]
    assert kinds == ["copy", "read", "read", "nonzero", "copy", "copy", "fetch"]
    assert counter.uploads == 1
    assert all(s.origin.startswith("models/test_syncs.py") for s in counter.syncs)


def test_host_work_that_names_the_cpu_is_declared():
    with SyncCounter() as counter, on_host():
        window = torch.hann_window(8, device="cpu")
        window.max().item()
    assert counter.total == 0


@pytest.fixture(scope="module")
def loaded(tiny_omni_dir):
    options = Qwen3OmniOptions(min_text_tokens=2, max_text_tokens=6, min_frames=2, max_frames=5)
    return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=options), tiny_omni_dir


@pytest.fixture(params=["eager", "static"])
def adapter(request, loaded):
    if request.param == "eager":
        return loaded[0]
    model, path = loaded
    static = Qwen3OmniAdapter(model.model, model.tokenizer,
                              load_preprocessor(path, model.model.config),
                              options=model.options, static_steps=True)
    static.warm_up(BATCH)
    return static


def _counted(calls: dict[str, list[SyncCounter]], stage: str, fn, *args):
    counter = SyncCounter()
    with counter:
        out = fn(*args)
    calls.setdefault(stage, []).append(counter)
    return out


@torch.inference_mode()
def test_every_stage_call_reads_from_the_device_at_most_once(adapter):
    rng = np.random.default_rng(0)
    states = [adapter.new_state(f"sync-{i}") for i in range(BATCH)]
    calls: dict[str, list[SyncCounter]] = {}
    try:
        chunks = [(0.1 * rng.standard_normal(16000)).astype(np.float32) for _ in range(BATCH)]
        feats = _counted(calls, "encode", adapter.encode_audio, states, chunks)
        _counted(calls, "prefill", adapter.thinker_prefill, states, feats)
        for state in states:
            adapter.begin_response(state)
        codes = [None] * BATCH
        # Through the replies' ends: the Thinker's EOS, the Talker's last frames, the codec
        # rows taken at a reply's first frame.
        for _ in range(7):
            tokens = _counted(calls, "thinker", adapter.thinker_decode, states)
            frames = _counted(calls, "talker", adapter.talker_step, states, tokens)
            codes = [f.codes if f.codes is not None else c
                     for f, c in zip(frames, codes, strict=True)]
            if all(c is not None for c in codes):
                _counted(calls, "codec", adapter.codec_decode, states, codes)
    finally:
        for state in states:
            adapter.free(state)
    assert set(calls) == {"encode", "prefill", "thinker", "talker", "codec"}
    for stage, counters in calls.items():
        for counter in counters:
            syncs = counter.syncs
            assert len(syncs) <= 1, f"{stage}: {[(s.kind, s.site, s.origin) for s in syncs]}"
            assert all(s.kind == "fetch" for s in syncs)
        fetched = sum(any(s.kind == "fetch" for s in c.syncs) for c in counters)
        # The input stages leave their output on the device; the others read what the host
        # needs: tokens, the codes' EOS, PCM.
        assert fetched == 0 if stage in ("encode", "prefill") else fetched > 0, stage
    # Every decode step went the way the adapter was built for.
    path = "eager" if adapter._thinker.graphs is None else "static"
    for stage in ("thinker", "talker", "code_predictor"):
        counts = adapter.graph_stats()[stage]
        assert counts[path] > 0 and sum(counts.values()) == counts[path], (stage, counts)

