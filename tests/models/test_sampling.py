"""The Qwen3-Omni adapter's sampler: one array draw for the whole batch, each row from its own
session's stream, with the distribution top-k and top-p ask for."""

from __future__ import annotations

import math

import pytest
import torch

from models.qwen3_omni.options import Sampling, Stream, sample, sample_rows

LOGITS = torch.tensor([[0.0, 1.0, 2.0, -math.inf, 0.5, 1.5, -1.0]])


def _expected(sampling: Sampling) -> torch.Tensor:
    """The distribution written out: temperature, the k best, the smallest head of mass
    top_p, renormalised."""
    probs = (LOGITS[0] / sampling.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (sampling.top_k and rank >= sampling.top_k) or mass >= sampling.top_p:
            break
        keep[i] = True
        mass += probs[i].item()
    kept = probs * keep
    return kept / kept.sum()


@pytest.mark.parametrize("sampling", [
    Sampling(1.0), Sampling(1.0, top_k=3), Sampling(1.0, top_p=0.7), Sampling(0.8, 4, 0.8),
])
def test_draws_follow_the_distribution_asked_for(sampling):
    n = 20000
    streams = [Stream(seed) for seed in range(n)]
    ids = sample(LOGITS.expand(n, -1), sampling, streams)
    freq = torch.bincount(ids, minlength=LOGITS.shape[1]).double() / n
    expected = _expected(sampling).double()
    assert freq[expected == 0].sum() == 0, "a token outside the candidates was drawn"
    # Four standard errors of a frequency over n draws.
    assert torch.all((freq - expected).abs() <= 4 * (expected * (1 - expected) / n).sqrt() + 1e-9)


def test_a_rows_draw_does_not_depend_on_the_rows_batched_with_it():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    sampling = Sampling(0.9, 20, 0.9)
    alone = [sample(logits[i : i + 1], sampling, [Stream(i)]).item() for i in range(6)]
    together = sample(logits, sampling, [Stream(i) for i in range(6)]).tolist()
    assert together == alone
    # The next draw of a stream is another number: sessions do not repeat themselves.
    streams = [Stream(7)]
    draws = {sample(torch.zeros(1, 1000), Sampling(1.0), streams).item() for _ in range(20)}
    assert len(draws) > 15


def test_greedy_rows_take_the_best_token_and_draw_nothing():
    stream = Stream(1)
    assert sample(LOGITS, Sampling(0.0), [stream]).item() == 2
    assert stream.drawn == 0


def test_rows_with_their_own_temperature_share_calls_by_sampling():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    samplings = [Sampling(0.0), Sampling(0.0), Sampling(1e-3)]
    assert sample_rows(logits, samplings, [Stream(0), Stream(1), Stream(2)]).tolist() == [1, 0, 2]


def test_greedy_rows_beside_sampled_ones_take_the_best_token_and_keep_their_stream():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    streams = [Stream(s) for s in range(4)]
    samplings = [Sampling(0.0), Sampling(0.9, 20), Sampling(0.0), Sampling(0.7, 20)]
    ids = sample_rows(logits, samplings, streams)
    assert ids[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()
    assert [s.drawn for s in streams] == [0, 1, 0, 1]
    # Each sampled row drew what it draws alone, at its own temperature.
    alone = [sample(logits[i : i + 1], samplings[i], [Stream(i)]).item() for i in (1, 3)]
    assert ids[[1, 3]].tolist() == alone
