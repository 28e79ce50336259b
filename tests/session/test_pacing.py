from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.session.events import OutputChunk
from duplex.session.pacing import OutputPacer

FRAME = 480


def chunks(n, size=1920):
    """`n` chunks of `size` samples, each sample's payload item its output position."""
    return [(OutputChunk(0, i, i * size, size, 0, f"w{i}"), list(range(i * size, (i + 1) * size)))
            for i in range(n)]


def released(pieces):
    return [x for _, payload in pieces for x in payload]


def test_release_keeps_within_the_lead_of_continuous_playback_in_whole_frames():
    pacer = OutputPacer(lead_samples=4800, frame_samples=FRAME)
    for c, p in chunks(10):
        pacer.push(c, p)
    first = pacer.due(0)
    # Chunks 0 and 1 whole, then chunk 2 up to the lead in whole frames (not all of it).
    assert [(c.start_sample, c.n_samples, c.text) for c, _ in first] == [
        (0, 1920, "w0"), (1920, 1920, "w1"), (3840, 960, "w2")]
    assert released(first) == list(range(4800))
    assert pacer.played(1000) == 1000
    later = pacer.due(1000)
    # The rest of chunk 2 carries no text; it is already in the piece before.
    assert [(c.start_sample, c.n_samples, c.text) for c, _ in later] == [
        (4800, 960, ""), (5760, 480, "w3")]
    assert pacer.tx_samples == 6240
    assert released(pacer.due(4800)) == list(range(6240, 9600))


def test_running_dry_restarts_playback_when_audio_comes_again():
    pacer = OutputPacer(lead_samples=0, frame_samples=FRAME)
    [(c0, p0), (c1, p1)] = chunks(2)
    pacer.push(c0, p0)
    # With no lead, one frame at a time as playback reaches it.
    assert released(pacer.due(100)) == p0[:FRAME]
    assert released(pacer.due(100 + FRAME)) == p0[FRAME : 2 * FRAME]
    assert pacer.played(100 + 5000) == 2 * FRAME  # dry: it cannot have played more than it got
    assert released(pacer.due(100_000)) == p0[2 * FRAME : 3 * FRAME]
    assert pacer.played(100_000 + 10) == 2 * FRAME + 10


def test_a_media_track_playhead_overrides_the_estimate_and_flush_rewinds():
    pacer = OutputPacer(lead_samples=1920, frame_samples=FRAME)
    for c, p in chunks(4):
        pacer.push(c, p)
    pacer.due(0)
    pacer.playhead = 500
    assert pacer.played(10**6) == 500
    pacer.flush()
    pacer.rewind(500)
    assert not pacer and pacer.tx_samples == 500


def test_a_resend_goes_out_again_from_what_was_heard_and_nothing_twice_after_it():
    pacer = OutputPacer(lead_samples=1920, frame_samples=FRAME, keep_unheard=True)
    for c, p in chunks(4):
        pacer.push(c, p)
    sent = released(pacer.due(0)) + released(pacer.due(960))
    assert sent == list(range(2880))
    pacer.heard(1000)
    # The carrier dropped what it held: from the last sample known heard, all again, in order,
    # and playback restarts from there.
    pacer.resend_from(1000)
    assert pacer.tx_samples == 1000 and pacer.played(10**6) == 1000
    again = released(pacer.due(5000))
    assert again[0] == 1000 and again == list(range(1000, again[-1] + 1))
    assert 1000 + 1920 <= again[-1] + 1 < 1000 + 1920 + FRAME
    rest = [x for now in range(5000, 20_000, FRAME) for x in released(pacer.due(now))]
    assert again + rest == list(range(1000, 7680))


@settings(max_examples=1000, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 160, 480]),
       st.lists(st.integers(0, 3000), min_size=1, max_size=40))
def test_never_ahead_of_playback_by_more_than_the_lead_and_a_frame(lead, frame, steps):
    pacer = OutputPacer(lead_samples=lead, frame_samples=frame)
    for c, p in chunks(30, size=480 * 3):
        pacer.push(c, p)
    now, out = 0, []
    for step in steps:
        now += step
        for chunk, payload in pacer.due(now):
            assert chunk.start_sample < pacer.played(now) + max(lead, 1)
            assert chunk.n_samples == len(payload) and payload[0] == chunk.start_sample
            out += payload
        assert pacer.tx_samples - pacer.played(now) < max(lead, 1) + frame
    # Every sample once, in order.
    assert out == list(range(len(out)))


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2000), st.booleans()), min_size=1, max_size=30))
def test_resends_lose_nothing_and_repeat_only_what_was_dropped(steps):
    """Whatever the carrier drops (a clear), what the listener hears is every sample once."""
    pacer = OutputPacer(lead_samples=960, frame_samples=160, keep_unheard=True)
    for c, p in chunks(20, size=480):
        pacer.push(c, p)
    now, heard, in_buffer = 0, [], []
    for step, clear in steps:
        now += step
        for _, payload in pacer.due(now):
            in_buffer += payload
        # The listener plays what it holds up to the pacer's estimate of playback.
        played = pacer.played(now)
        while in_buffer and in_buffer[0] < played:
            heard.append(in_buffer.pop(0))
        pacer.heard(heard[-1] + 1 if heard else 0)
        if clear:
            in_buffer.clear()
            pacer.resend_from(heard[-1] + 1 if heard else 0)
    assert heard == list(range(len(heard)))
