"""engine.cuda_graphs on a machine without CUDA: the fixed-buffer code predictor loop a graph
would hold gives the eager path's codes, its sampling draws from the same distribution, and on a
CPU model the switch leaves everything as it was. The graph replay itself needs a GPU and is
not tested here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions, Sampling
from models.qwen3_omni.graphs import (
    BUCKETS,
    GraphedResidual,
    StaticResidual,
    bucket,
    gumbel_draw,
    residual_graphs,
)
from models.qwen3_omni.options import Stream, filtered
from models.qwen3_omni.tiny import build_tiny, load_preprocessor

ARGMAX = Sampling(0.0)
GREEDY = Qwen3OmniOptions(
    min_text_tokens=2, max_text_tokens=4, min_frames=3, max_frames=4,
    talker_sampling=Sampling(0.0), residual_sampling=Sampling(0.0),
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-omni"))


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return Qwen3OmniAdapter.from_pretrained(checkpoint, options=GREEDY)


def static(talker, batch: int, sampling: Sampling = ARGMAX) -> StaticResidual:
    return StaticResidual(talker.predictor, talker.module.get_input_embeddings(),
                          talker.num_codes, batch, sampling, "cpu", torch.float32)


def test_buckets_hold_every_batch_up_to_the_largest():
    assert [bucket(n) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert bucket(BUCKETS[-1] + 1) is None


@torch.inference_mode()
def test_static_buffers_have_fixed_shapes(adapter):
    talker = adapter._talker
    config = talker.predictor.config
    runner = static(talker, 4)
    assert runner.shapes == {
        "hidden": (4, config.hidden_size),
        "first": (4,),
        "noise": (4, talker.num_codes - 1, config.vocab_size),
        "codes": (4, talker.num_codes),
        "kv": (4, config.num_key_value_heads, talker.num_codes, config.head_dim),
    }
    buffers = [runner.codes, *runner.kv.keys, *runner.kv.values]
    addresses = [t.data_ptr() for t in buffers]
    runner.run()
    runner.run()
    assert [t.data_ptr() for t in buffers] == addresses


@torch.inference_mode()
def test_fixed_buffer_loop_gives_the_eager_codes_frame_after_frame(adapter):
    talker = adapter._talker
    runner = static(talker, 4)
    rng = torch.Generator().manual_seed(7)
    for _ in range(3):
        # Three rows in a bucket of four; earlier frames' keys stay in the buffers, masked.
        hidden = torch.randn(3, talker.predictor.config.hidden_size, generator=rng)
        first = torch.randint(0, talker.predictor.config.vocab_size, (3,), generator=rng)
        eager = talker._residual_codes(hidden, first, [_session()] * 3)
        runner.load(hidden, first, [None] * 3)
        runner.run()
        assert torch.equal(runner.codes[:3], eager)


def test_gumbel_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, -6.0]])
    sampling = Sampling(0.9, top_k=5, top_p=0.9)
    probs = filtered(logits, sampling).softmax(-1)[0]
    noise = torch.rand(20000, logits.shape[1], generator=torch.Generator().manual_seed(3))
    draws = gumbel_draw(logits.expand(20000, -1), noise, sampling)
    freq = torch.bincount(draws, minlength=logits.shape[1]).double() / len(draws)
    assert set(draws.tolist()) <= set(torch.nonzero(probs).flatten().tolist())
    assert torch.allclose(freq, probs.double(), atol=0.015)
    assert torch.equal(gumbel_draw(logits, noise[:1], Sampling(0.0)), torch.tensor([0]))


@torch.inference_mode()
def test_sampled_codes_come_from_each_sessions_own_generator(adapter):
    talker = adapter._talker
    sampling = Sampling(1.0, 50, 0.8)
    runner = static(talker, 2, sampling)
    hidden = torch.randn(2, talker.predictor.config.hidden_size,
                         generator=torch.Generator().manual_seed(1))
    first = torch.tensor([5, 9])

    def frame(seeds):
        runner.load(hidden, first, [Stream(s) for s in seeds])
        runner.run()
        return runner.codes.clone()

    a, b, c = frame([1, 2]), frame([1, 2]), frame([1, 3])
    assert torch.equal(a, b)
    assert torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])


def test_the_switch_builds_nothing_for_a_cpu_model(adapter, monkeypatch):
    talker = adapter._talker

    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA graph was touched for a CPU model")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_cuda)
    monkeypatch.setattr(torch.cuda, "graph", no_cuda)
    args = (talker.predictor, talker.module.get_input_embeddings(), talker.num_codes,
            Sampling(0.0), "cpu", torch.float32)
    assert residual_graphs(*args, enabled=False) is None
    assert residual_graphs(*args, enabled=True) is None
    assert isinstance(residual_graphs(*args[:4], "cuda", torch.bfloat16, enabled=True),
                      GraphedResidual)


def run_reply(model: Qwen3OmniAdapter) -> list[list[int]]:
    state = model.new_state("s1")
    speech = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    model.thinker_prefill([state], model.encode_audio([state], [speech]))
    model.begin_response(state)
    codes = []
    for _ in range(3):
        frame = model.talker_step([state], model.thinker_decode([state]))[0]
        codes.append(frame.codes.tolist())
    model.free(state)
    return codes


def test_cuda_graphs_on_a_cpu_model_change_nothing(checkpoint, adapter, monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA graph was touched for a CPU model")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", no_cuda)
    prep = load_preprocessor(checkpoint, adapter.model.config)
    on = Qwen3OmniAdapter(adapter.model, adapter.tokenizer, prep, options=GREEDY, cuda_graphs=True)
    off = Qwen3OmniAdapter(adapter.model, adapter.tokenizer, prep, options=GREEDY)
    assert on._talker.graphs is None
    assert run_reply(on) == run_reply(off)


@torch.inference_mode()
def test_a_failed_capture_falls_back_to_the_eager_path(adapter, caplog):
    # Without CUDA every capture fails: the runner says so once and the Talker runs eager.
    talker = adapter._talker
    runner = GraphedResidual(lambda batch: static(talker, batch))
    hidden = torch.randn(2, talker.predictor.config.hidden_size)
    first = torch.tensor([1, 2])
    assert runner(hidden, first, [None, None]) is None
    assert runner.failed
    assert runner(hidden, first, [None, None]) is None
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    talker.graphs = runner
    try:
        assert talker._residual_codes(hidden, first, [_session()] * 2).shape == (2, talker.num_codes)
    finally:
        talker.graphs = None


def _session() -> SimpleNamespace:
    """What the code predictor reads of a session: a reply temperature that is not greedy
    (so the checkpoint's own sampling applies) and no generator of its own."""
    return SimpleNamespace(temperature=None, talker_gen=None)
