"""engine.cuda_graphs on a machine without CUDA: the fixed-buffer code predictor loop a graph
would hold gives the eager path's codes (greedy rows too), its sampling draws from the same
distribution with noise that cannot reach 1.0, the buckets captured at start are every one a
batch may need, and on a CPU model the switch leaves everything as it was. The graph replay
itself needs a GPU and is not tested here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models.cuda_graphs import (
    BUCKETS,
    BucketGraphs,
    GraphSettings,
    bucket,
    capture_plan,
    graph_settings,
)
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions, Sampling
from models.qwen3_omni.graphs import (
    GraphedResidual,
    StaticResidual,
    gumbel_draw,
    residual_graphs,
)
from models.qwen3_omni.options import NOISE_MAX, Stream, counters, filtered, uniform32
from models.qwen3_omni.tiny import load_preprocessor

ARGMAX = Sampling(0.0)
GREEDY = Qwen3OmniOptions(
    min_text_tokens=2, max_text_tokens=4, min_frames=3, max_frames=4,
    talker_sampling=Sampling(0.0), residual_sampling=Sampling(0.0),
)


@pytest.fixture(scope="module")
def checkpoint(tiny_omni_dir):
    return tiny_omni_dir


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return Qwen3OmniAdapter.from_pretrained(checkpoint, options=GREEDY)


def static(talker, batch: int, sampling: Sampling = ARGMAX) -> StaticResidual:
    return StaticResidual(talker.predictor, talker.module.get_input_embeddings(),
                          talker.num_codes, batch, sampling, "cpu", torch.float32)


def test_buckets_hold_every_batch_up_to_the_largest():
    assert [bucket(n) for n in (1, 2, 3, 5, 33, 64, 65, 128)] == [1, 2, 4, 8, 64, 64, 128, 128]
    assert bucket(BUCKETS[-1] + 1) is None


def test_the_start_captures_every_bucket_a_batch_may_need_largest_first():
    assert capture_plan(1) == (1,)
    assert capture_plan(8) == (8, 4, 2, 1)
    assert capture_plan(64) == (64, 32, 16, 8, 4, 2, 1)
    assert capture_plan(65) == capture_plan(128) == BUCKETS[::-1]
    assert capture_plan(1000) == BUCKETS[::-1]


def test_warm_up_captures_the_plan_and_nothing_is_captured_while_serving(monkeypatch):
    runner = GraphedResidual(lambda batch: None)
    asked: list[int] = []

    def capture(size: int) -> bool:
        asked.append(size)
        runner._graphs[size] = runner._static[size] = None
        return True

    monkeypatch.setattr(runner, "_prepare", capture)
    assert runner.warm_up(20) == (1, 2, 4, 8, 16, 32)
    assert asked == [32, 16, 8, 4, 2, 1]
    assert runner.holds(32) and not runner.holds(33)
    assert runner.warm_up(20) == (1, 2, 4, 8, 16, 32) and len(asked) == 6
    # A failed capture stops the warm-up and leaves every batch to the eager path.
    failing = GraphedResidual(lambda batch: None)
    monkeypatch.setattr(failing, "_prepare", lambda size: setattr(failing, "failed", True))
    assert failing.warm_up(128) == ()
    assert not failing.holds(1)


@torch.inference_mode()
def test_static_buffers_have_fixed_shapes(adapter):
    talker = adapter._talker
    config = talker.predictor.config
    runner = static(talker, 4)
    assert runner.shapes == {
        "hidden": (4, config.hidden_size),
        "first": (4,),
        "counts": (2, 4),
        "greedy": (4,),
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
        eager = talker._residual_codes(hidden, first, [_session() for _ in range(3)])
        runner.load(hidden, first, counters([Stream(0)] * 3, "cpu"), torch.ones(3, dtype=bool))
        runner.run()
        assert torch.equal(runner.codes[:3], eager)


@torch.inference_mode()
def test_greedy_rows_take_the_graph_beside_sampled_ones(adapter):
    """A reply at temperature 0 is greedy in its codes: in a graph that samples, its rows take
    the argmax (the eager greedy codes), and the sampled rows beside them draw what they would
    have drawn in a batch of sampled rows alone."""
    talker = adapter._talker
    runner = static(talker, 4, Sampling(1.0, 50, 0.8))
    hidden = torch.randn(4, talker.predictor.config.hidden_size,
                         generator=torch.Generator().manual_seed(2))
    first = torch.tensor([3, 7, 11, 5])
    greedy = talker._residual_codes(hidden, first, [_session(0.0) for _ in range(4)])
    counts = counters([Stream(s) for s in range(4)], "cpu")
    runner.load(hidden, first, counts, torch.zeros(4, dtype=torch.bool))
    runner.run()
    sampled = runner.codes.clone()
    mixed = torch.tensor([True, False, True, False])
    runner.load(hidden, first, counts, mixed)
    runner.run()
    assert torch.equal(runner.codes[mixed], greedy[mixed])
    assert torch.equal(runner.codes[~mixed], sampled[~mixed])
    assert not torch.equal(sampled, greedy)


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


def test_noise_at_one_never_draws_outside_top_k():
    """Noise of exactly 1.0 (float64 noise rounded to float32 used to reach it) on a filtered
    token: unheld, its Gumbel term is +inf, plus -inf is NaN, and argmax takes the NaN."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    top2 = Sampling(1.0, top_k=2)
    noise = torch.tensor([[0.5, 0.5, 0.5, 1.0]])
    unheld = filtered(logits, top2) - torch.log(-torch.log(noise))
    assert unheld[0, 3].isnan() and unheld.argmax(-1).item() == 3
    assert gumbel_draw(logits, noise, top2).item() in (0, 1)
    assert gumbel_draw(logits, torch.ones(1, 4), top2).item() == 0


def test_device_noise_stays_below_one():
    """The graphs' noise is 24 bits made exact in float32: the largest is 1 - 2^-24."""
    assert NOISE_MAX < 1.0 and torch.tensor(NOISE_MAX, dtype=torch.float32).item() == NOISE_MAX
    noise = uniform32(counters([Stream(s) for s in range(64)], "cpu"), 4096)
    assert noise.dtype == torch.float32
    assert 0.0 <= noise.min().item() and noise.max().item() <= NOISE_MAX
    assert abs(noise.mean().item() - 0.5) < 0.01


@torch.inference_mode()
def test_sampled_codes_come_from_each_sessions_own_generator(adapter):
    talker = adapter._talker
    sampling = Sampling(1.0, 50, 0.8)
    runner = static(talker, 2, sampling)
    hidden = torch.randn(2, talker.predictor.config.hidden_size,
                         generator=torch.Generator().manual_seed(1))
    first = torch.tensor([5, 9])

    def frame(seeds):
        counts = counters([Stream(s) for s in seeds], "cpu")
        runner.load(hidden, first, counts, torch.zeros(2, dtype=torch.bool))
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
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", no_cuda)
    args = (talker.predictor, talker.module.get_input_embeddings(), talker.num_codes,
            Sampling(0.0), "cpu", torch.float32)
    assert graph_settings(False, False, "cpu") == GraphSettings()
    assert graph_settings(True, False, "cpu") == GraphSettings()
    assert residual_graphs(*args, graph_settings(True, False, "cpu")) is None
    assert graph_settings(False, True, "cpu") == GraphSettings(static=True)
    on_gpu = graph_settings(True, False, "cuda")
    assert on_gpu == GraphSettings(static=True, capture=True)
    assert isinstance(residual_graphs(*args[:4], "cuda", torch.bfloat16, on_gpu), GraphedResidual)


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
    assert on._talker.graphs is None and on._talker.step_graphs is None
    assert on._thinker.graphs is None
    assert run_reply(on) == run_reply(off)
    assert on.warm_up(8) == off.warm_up(8)


@torch.inference_mode()
def test_a_failed_capture_falls_back_to_the_eager_path(adapter, caplog):
    # Without CUDA every capture fails: the runner says so once and the Talker runs eager.
    talker = adapter._talker
    runner = GraphedResidual(lambda batch: static(talker, batch))
    hidden = torch.randn(2, talker.predictor.config.hidden_size)
    first = torch.tensor([1, 2])
    assert runner.warm_up(64) == ()
    assert runner.failed and not runner.holds(1)
    assert runner.warm_up(64) == ()
    assert sum("capture failed" in r.getMessage() for r in caplog.records) == 1
    talker.graphs = runner
    eager_frames = talker.frames["eager"]
    try:
        eager = talker._residual_codes(hidden, first, [_session(), _session()])
        assert eager.shape == (2, talker.num_codes)
        assert talker.frames["eager"] == eager_frames + 1
    finally:
        talker.graphs = None


def _session(temperature: float | None = None) -> SimpleNamespace:
    """What the code predictor reads of a session: its reply's temperature (None: the
    checkpoint's own sampling applies; 0: greedy) and its stream."""
    return SimpleNamespace(temperature=temperature, talker_gen=Stream(0))


def test_steps_whose_experts_cannot_be_captured_are_not_tried(adapter, monkeypatch):
    """transformers' eager experts loop with a host sync per expert: a capture of the Thinker's
    steps would fail on it, so the start does not try, and says why."""
    made: list[int] = []
    runner = BucketGraphs("Thinker decode", lambda batch: made.append(batch), capture=True)
    monkeypatch.setattr(adapter._thinker, "graphs", runner)
    monkeypatch.setattr(adapter, "experts", {"talker": "grouped_mm", "thinker": "eager"})
    report = adapter.warm_up(8)
    assert report["thinker_graphs"] == [] and made == []
    assert "thinker decode steps not captured: its experts are not on grouped_mm" in \
        report["warnings"]
    assert not runner.holds(1)
