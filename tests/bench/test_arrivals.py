"""When the bench's sessions start and how they talk: the herd and Poisson arrivals, and one
short bench run of each on the echo model."""

from __future__ import annotations

import statistics

import pytest

from duplex.bench.arrivals import scripts
from duplex.bench.run import bench
from duplex.bench.speech import TEXTS, lengths_s


def test_a_herd_starts_within_a_second_and_barges_in_on_every_other_reply():
    plans = scripts("herd", 50, 10.0, seed=3)
    assert all(0 <= p.start_s < 1.0 for p in plans)
    for p in plans:
        assert all(1.0 <= t <= min(2.0, lengths_s()[u])
                   for u, t in zip(p.utterance, p.turn_s, strict=True))
        assert p.barge_in[:4] == (False, True, False, True)


def test_poisson_arrivals_spread_over_the_first_half_of_the_run():
    n, duration = 2000, 20.0
    plans = scripts("poisson", n, duration, seed=1)
    starts = [p.start_s for p in plans]
    assert starts == sorted(starts) and 0 < starts[0] and starts[-1] < duration / 2
    assert starts[-1] == pytest.approx(duration / 2, rel=0.01)
    # The gaps of a Poisson process are exponential: as spread as they are long.
    gaps = [b - a for a, b in zip([0.0, *starts], starts, strict=False)]
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)
    # Poisson callers say whole recordings, each of them.
    for p in plans:
        assert p.turn_s == tuple(lengths_s()[u] for u in p.utterance)
    assert {u for p in plans for u in p.utterance} == set(range(len(TEXTS)))
    barges = [b for p in plans for b in p.barge_in]
    assert 0.45 < sum(barges) / len(barges) < 0.55


def test_the_same_seed_draws_the_same_run_and_another_seed_another():
    for arrivals in ("herd", "poisson"):
        assert scripts(arrivals, 8, 10.0, seed=5) == scripts(arrivals, 8, 10.0, seed=5)
        assert scripts(arrivals, 8, 10.0, seed=5) != scripts(arrivals, 8, 10.0, seed=6)


def test_an_unknown_arrivals_pattern_is_refused():
    with pytest.raises(ValueError, match="herd, poisson"):
        scripts("burst", 2, 5.0)


@pytest.mark.parametrize("arrivals", ["herd", "poisson"])
def test_a_bench_run_serves_every_session_and_reports_its_arrivals(arrivals, tmp_path):
    report = bench("echo", str(tmp_path), sessions=3, duration_s=10.0, baseline=False,
                   find=False, limit=3, log=lambda line: None, in_process=True,
                   arrivals=arrivals, seed=2)
    assert (report["arrivals"], report["seed"]) == (arrivals, 2)
    run = report["modes"]["batched"]
    assert run["sessions"] == 3 and run["reply_audio_s"] > 0
    assert run["bytes_held_after_close"] == 0
    # A caller barges in on the reply to its own turn once it hears it: every reply cut was
    # talked over while heard, so each barge-in's pause is timed (a herd's second turn is one).
    # A pause need not end in a cut: a reply that ends before the interruption is confirmed
    # (a slow engine, a short echo) is paused and done, not cancelled.
    assert run["barge_in_ms"]["n"] <= run["pause_ms"]["n"]
    assert run["pause_ms"]["n"] >= (1 if arrivals == "herd" else 0)
    # Each session heard at least one reply, and the report says how many it timed.
    assert run["ttfa_ms"]["p50"] is not None and run["ttfa_ms"]["n"] >= 3
    # The engine's CPU time is counted within its busy time: never more, and some of it.
    assert 0 < run["engine_cpu_share"] <= 1
    assert 0 < run["engine_cpu_ms_per_session_frame"] <= run["engine_ms_per_session_frame"]
