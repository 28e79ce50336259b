from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.session.events import OutputChunk
from duplex.session.pacing import OutputPacer


def chunks(n, size=1920):
    return [OutputChunk(0, i, i * size, size, 0) for i in range(n)]


def test_release_keeps_within_the_lead_of_continuous_playback():
    pacer = OutputPacer(lead_samples=4800)
    for c in chunks(10):
        pacer.push(c, c.seq)
    assert [p for _, p in pacer.due(0)] == [0, 1, 2]
    assert pacer.played(1000) == 1000
    assert [p for _, p in pacer.due(4800)] == [3, 4]
    assert pacer.tx_samples == 5 * 1920


def test_running_dry_restarts_playback_when_audio_comes_again():
    pacer = OutputPacer(lead_samples=0)
    [c0, c1] = chunks(2)
    pacer.push(c0, "a")
    assert pacer.due(100) == [(c0, "a")]
    assert pacer.played(100 + 5000) == 1920  # dry: it cannot have played more than it got
    pacer.push(c1, "b")
    assert pacer.due(100_000) == [(c1, "b")]
    assert pacer.played(100_000 + 10) == 1920 + 10


def test_a_media_track_playhead_overrides_the_estimate_and_flush_rewinds():
    pacer = OutputPacer(lead_samples=1920)
    for c in chunks(4):
        pacer.push(c, None)
    pacer.due(0)
    pacer.playhead = 500
    assert pacer.played(10**6) == 500
    pacer.flush()
    pacer.rewind(500)
    assert not pacer and pacer.tx_samples == 500


@settings(max_examples=1000, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.integers(0, 3000), min_size=1, max_size=40))
def test_never_ahead_of_playback_by_more_than_the_lead(lead, steps):
    pacer = OutputPacer(lead_samples=lead)
    for c in chunks(30, size=480):
        pacer.push(c, None)
    now = 0
    for step in steps:
        now += step
        for chunk, _ in pacer.due(now):
            assert chunk.start_sample < pacer.played(now) + max(lead, 1)
        assert pacer.played(now) <= pacer.tx_samples
