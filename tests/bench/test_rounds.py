"""A mode measured in several rounds reports its median round and every round's figures, so a
noisy maximum shows as a range instead of passing for the figure."""

from __future__ import annotations

from duplex.bench.run import _median, _spread


def _round(efficiency: float, sessions: int, ceiling: float, tag: str) -> dict:
    return {"efficiency": efficiency, "max_realtime_sessions": sessions,
            "ceiling_sessions": ceiling, "rtf": 0.1, "tag": tag}


def test_the_median_round_stands_for_the_mode_with_the_ranges_beside_it():
    runs = [_round(0.70, 41, 58.6, "a"), _round(0.91, 52, 57.1, "b"), _round(0.82, 47, 57.3, "c")]
    mode = _median(runs, find=True)
    assert mode["tag"] == "c"
    assert mode["efficiency"] == 0.82 and mode["efficiency_range"] == [0.70, 0.91]
    assert mode["max_realtime_sessions"] == 47 and mode["max_realtime_sessions_range"] == [41, 52]
    assert [r["efficiency"] for r in mode["rounds"]] == [0.70, 0.91, 0.82]
    assert _spread(mode, "efficiency") == "0.7-0.91 (3)"


def test_an_even_number_of_rounds_reports_the_middle_value():
    mode = _median([_round(0.6, 40, 60.0, "a"), _round(0.8, 48, 60.0, "b")], find=True)
    assert mode["efficiency"] == 0.7 and mode["max_realtime_sessions"] == 44


def test_one_round_is_reported_as_it_is():
    run = _round(0.75, 45, 60.0, "a")
    assert _median([run], find=True) == run
    assert _spread(run, "efficiency") == "-"
