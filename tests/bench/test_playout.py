"""The listeners' playback clock, driven by hand: a phone's buffer, a client's playout."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.bench.playout import Playout


def ramp(a: int, b: int) -> np.ndarray:
    return np.arange(a, b, dtype=np.float32)


def test_audio_plays_back_to_back_in_real_time_and_marks_come_back_as_it_reaches_them():
    p = Playout()
    assert p.push(100, ramp(0, 160), "r0") == 100
    assert p.mark(100, "m0") == 260
    # Arriving while the first still plays, the next frame waits for it.
    assert p.push(150, ramp(160, 320), "r0") == 260
    assert p.mark(150, "m1") == 420
    assert p.reached(259) == [] and p.reached(260) == ["m0"] and p.reached(1000) == ["m1"]
    assert p.playing(300, "r0") and not p.playing(420)
    # After running dry, audio plays from when it arrives.
    assert p.push(1000, ramp(320, 480), "r0") == 1000
    assert p.breaks("r0") == [(420, 1000)]
    assert np.array_equal(p.heard("r0"), ramp(0, 480))
    assert np.array_equal(p.heard("r0", now=300), ramp(0, 200))


def test_a_clear_drops_what_has_not_played_at_once_and_gives_back_its_marks():
    p = Playout()
    p.push(0, ramp(0, 800), "r0")
    p.mark(0, "a")
    p.push(0, ramp(800, 1600), "r0")
    p.mark(0, "b")
    # "a" was played before the clear (it comes back as played); "b" is dropped.
    assert p.clear(1000) == ["b"] and p.reached(1000) == ["a"]
    assert not p.playing(1000) and p.end == 1000
    assert np.array_equal(p.heard("r0"), ramp(0, 1000))
    # Playback of the reply under way at 300 stopped at the clear.
    assert p.stopped(300, "r0") == 1000
    # A resend plays from when it arrives; the reply heard is still every sample once.
    p.push(1500, ramp(1000, 1600), "r0")
    assert p.stopped(300, "r0") == 1000 and p.stopped(1600, "r0") == 2100
    assert np.array_equal(p.heard("r0"), ramp(0, 1600))
    assert p.stopped(1200, "r0") is None  # nothing of it played then
    assert p.clears == [1000]


def test_a_reply_that_ran_dry_stopped_where_it_did_and_other_audio_is_not_it():
    p = Playout()
    p.push(0, ramp(0, 480), "r0")
    p.push(480, ramp(0, 480), None)
    p.push(960, ramp(480, 960), "r0")
    assert p.stopped(100, "r0") == 480
    assert p.tag_at(500) is None and p.tag_at(1000) == "r0"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(1, 400), st.booleans()),
                min_size=1, max_size=30))
def test_what_played_is_never_more_than_the_time_passed_nor_out_of_order(steps):
    p = Playout()
    now, sent = 0, 0
    for wait, n, clear in steps:
        now += wait
        if clear:
            p.clear(now)
        p.push(now, ramp(sent, sent + n), "r")
        sent += n
    heard = p.heard("r", now=now)
    # Played in order, each sample at most once, no faster than real time.
    assert np.all(np.diff(heard) > 0)
    assert len(heard) <= now


def test_what_a_loudspeaker_gave_out_between_two_times():
    p = Playout()
    p.push(100, ramp(1, 161), "r0")
    p.push(400, ramp(161, 321), "r1")
    out = p.between(200, 500)
    assert np.array_equal(out[:60], ramp(101, 161)) and not out[60:200].any()
    assert np.array_equal(out[200:], ramp(161, 261))
    assert p.played(450) == 160 + 50


def test_a_player_that_pauses_takes_back_what_it_had_not_played_and_plays_it_on_later():
    p = Playout()
    p.push(0, ramp(0, 300), "r0")
    p.push(0, ramp(300, 500), "r0")
    taken = p.take(200)
    assert [(list(a[[0, -1]]), tag) for a, tag in taken] == [([200, 299], "r0"), ([300, 499], "r0")]
    assert not p.playing(250)
    for pcm, tag in taken:
        p.push(700, pcm, tag)
    assert np.array_equal(p.heard("r0"), ramp(0, 500)) and p.breaks("r0") == [(200, 700)]


def test_where_playback_of_what_was_sent_before_a_pause_ended():
    p = Playout()
    p.push(0, ramp(0, 300), "r0")
    p.push(100, ramp(300, 400), "r0")
    # Sent after the pause at 150: the resumed reply, which does not count.
    p.push(900, ramp(400, 500), "r0")
    assert p.last_played("r0", 150) == 400 and p.last_played("r0", 10_000) == 1000
    p.clear(350)
    assert p.last_played("r0", 150) == 350
    # A listener that knows when the server sent each piece says so.
    p.push(2000, ramp(500, 600), "r1", sent=1500)
    assert p.last_played("r1", 1600) == 2100 and p.last_played("r1", 1400) is None
