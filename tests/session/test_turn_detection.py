"""Server VAD's hysteresis, with speech scored ahead of the chunk grid (`feed_early`)."""

from hypothesis import given
from hypothesis import strategies as st

from duplex.session.commands import SpeechStarted, SpeechStopped
from duplex.session.turn_detection import TurnDetector

CHUNK = 768


def test_speech_scored_ahead_starts_where_its_chunk_will_and_the_chunk_goes_on_from_it():
    d = TurnDetector(silence_samples=3 * CHUNK)
    assert d.feed(0.1, CHUNK) is None and d.feed_early(0.2) is None
    assert d.feed_early(0.8) == SpeechStarted(CHUNK)
    # Its chunk, and the speech after it, start nothing more.
    assert [d.feed(0.9, CHUNK), d.feed_early(0.9), d.feed(0.9, CHUNK)] == [None, None, None]
    stops = [d.feed(0.1, CHUNK) for _ in range(3)]
    assert stops == [None, None, SpeechStopped(3 * CHUNK)]


def test_speech_scored_ahead_that_its_chunk_does_not_confirm_ends_like_any_speech():
    d = TurnDetector(silence_samples=2 * CHUNK)
    d.feed(0.0, CHUNK)
    assert d.feed_early(0.6) == SpeechStarted(CHUNK)
    assert [d.feed(0.2, CHUNK), d.feed(0.2, CHUNK)] == [None, SpeechStopped(CHUNK)]
    assert d.feed_early(0.7) == SpeechStarted(3 * CHUNK)


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 1)), max_size=80))
def test_starts_and_stops_alternate_whatever_is_scored_ahead(steps):
    d = TurnDetector(silence_samples=2 * CHUNK)
    decisions = []
    for ahead, prob in steps:
        decision = d.feed_early(prob) if ahead else d.feed(prob, CHUNK)
        if decision is not None:
            decisions.append(decision)
    kinds = [type(x) for x in decisions]
    assert kinds == [SpeechStarted, SpeechStopped] * (len(kinds) // 2) + [SpeechStarted] * (len(kinds) % 2)
    positions = [x.at_sample for x in decisions]
    assert positions == sorted(positions) and all(p <= d.position for p in positions)
    assert d.speaking == (len(kinds) % 2 == 1)
