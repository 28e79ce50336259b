"""semantic_vad's decisions: a pause is scored once, a complete score ends the turn it was
asked about (and no other), and a pause as long as eagerness's longest wait ends it anyway."""

from hypothesis import given
from hypothesis import strategies as st

from duplex.session.commands import SpeechStarted, SpeechStopped
from duplex.session.turn_detection import ScoreTurn, TurnDetector

CHUNK = 768
PAUSE = 7 * CHUNK
ASK = 4 * CHUNK
WAIT = 40 * CHUNK


def semantic(ask: int | None = None) -> TurnDetector:
    return TurnDetector(silence_samples=WAIT, pause_samples=PAUSE, ask_samples=ask)


def feed(d: TurnDetector, probs: list[float]) -> list:
    return [x for x in (d.feed(p, CHUNK) for p in probs) if x is not None]


def test_a_pause_is_scored_once_and_a_complete_turn_ends_at_its_speech_end():
    d = semantic()
    assert feed(d, [0.1, 0.9, 0.9]) == [SpeechStarted(CHUNK)]
    asked = feed(d, [0.1] * 10)
    assert asked == [ScoreTurn(1, CHUNK, 3 * CHUNK + PAUSE)]
    assert d.score(1, 0.93) == SpeechStopped(3 * CHUNK, "model")
    assert not d.speaking and d.score(1, 0.93) is None


def test_an_incomplete_turn_stays_open_until_the_fallback_wait():
    d = semantic()
    feed(d, [0.9, 0.1])
    asked = feed(d, [0.1] * 6)
    assert d.score(asked[0].request, 0.04) is None and d.speaking
    rest = feed(d, [0.1] * (WAIT // CHUNK))
    assert rest == [SpeechStopped(CHUNK, "fallback")]


def test_speech_after_the_question_makes_its_answer_stale_and_the_next_pause_asks_again():
    d = semantic()
    feed(d, [0.9])
    first = feed(d, [0.1] * 7)[0]
    feed(d, [0.8, 0.8])
    assert d.score(first.request, 0.99) is None and d.speaking
    second = feed(d, [0.1] * 7)
    assert second == [ScoreTurn(first.request + 1, 0, 10 * CHUNK + PAUSE)]
    assert d.score(second[0].request, 0.99) == SpeechStopped(10 * CHUNK, "model")


def test_a_model_that_cannot_judge_leaves_the_fallback():
    d = semantic()
    feed(d, [0.9])
    asked = feed(d, [0.1] * 7)[0]
    assert d.score(asked.request, None) is None and d.speaking


def test_a_false_interruption_forgets_the_question():
    d = semantic()
    feed(d, [0.9])
    asked = feed(d, [0.1] * 7)[0]
    d.forget_speech()
    assert d.score(asked.request, 0.99) is None


def test_asked_early_a_complete_turn_ends_once_the_pause_has_lasted():
    d = semantic(ASK)
    feed(d, [0.9, 0.9])
    asked = feed(d, [0.1] * 4)
    assert asked == [ScoreTurn(1, 0, 6 * CHUNK)]
    assert d.score(1, 0.97) is None and d.speaking
    assert feed(d, [0.1, 0.1]) == []
    assert feed(d, [0.1]) == [SpeechStopped(2 * CHUNK, "model")]


def test_asked_early_the_answer_comes_after_the_pause_and_ends_the_turn_at_once():
    d = semantic(ASK)
    feed(d, [0.9])
    asked = feed(d, [0.1] * 9)[0]
    assert d.score(asked.request, 0.8) == SpeechStopped(CHUNK, "model")


def test_asked_early_a_pause_shorter_than_the_end_is_no_end_whatever_the_model_says():
    d = semantic(ASK)
    feed(d, [0.9])
    asked = feed(d, [0.1] * 5)[0]
    assert d.score(asked.request, 0.99) is None
    assert feed(d, [0.9] + [0.1] * 3) == []
    assert d.speaking


def test_server_vad_never_asks():
    d = TurnDetector(silence_samples=4 * CHUNK)
    assert feed(d, [0.9] + [0.1] * 4) == [SpeechStarted(0), SpeechStopped(CHUNK, "silence")]


steps = st.lists(st.one_of(st.floats(0, 1), st.tuples(st.floats(0, 1))), max_size=150)


@given(steps, st.sampled_from([None, ASK]))
def test_turns_alternate_and_only_the_latest_question_of_an_unbroken_pause_ends_one(script, ask):
    """Chunks (a float) and answers (a 1-tuple: to the latest question, whenever it comes)."""
    d = semantic(ask)
    ask_at = PAUSE if ask is None else ask
    said_complete = False
    decisions: list = []
    last_asked: ScoreTurn | None = None
    silence_since_asked = False
    for step in script:
        if isinstance(step, tuple):
            if last_asked is None:
                continue
            before = d.speaking
            out = d.score(last_asked.request, step[0])
            if out is not None:
                # Only while the pause it was asked in lasts, only once that pause is long
                # enough, and only when it said complete.
                assert before and silence_since_asked and step[0] >= d.complete_threshold
                assert out.ended_by == "model" and d.silence_run == 0
                decisions.append(out)
            elif before and silence_since_asked and step[0] >= d.complete_threshold:
                said_complete = True
            continue
        pause_before = d.silence_run
        out = d.feed(step, CHUNK)
        if step >= d.threshold:
            silence_since_asked = said_complete = False
        if isinstance(out, ScoreTurn):
            # Asked once per pause, when it has lasted ask_at, about the turn's speech so far.
            assert d.silence_run >= ask_at and d.silence_run - CHUNK < ask_at
            assert out.end == d.position and out.onset <= d.speech_end <= out.end
            last_asked, silence_since_asked, said_complete = out, True, False
        elif out is not None:
            decisions.append(out)
            if isinstance(out, SpeechStopped) and out.ended_by == "model":
                # A pause judged complete ends the turn the moment it is long enough.
                assert said_complete and pause_before < PAUSE <= pause_before + CHUNK
            elif isinstance(out, SpeechStopped):
                assert out.ended_by == "fallback"
            said_complete = False
    kinds = [type(x) for x in decisions]
    assert kinds == [SpeechStarted, SpeechStopped] * (len(kinds) // 2) + [SpeechStarted] * (len(kinds) % 2)
    stops = [x.at_sample for x in decisions if isinstance(x, SpeechStopped)]
    starts = [x.at_sample for x in decisions if isinstance(x, SpeechStarted)]
    assert all(a <= b for a, b in zip(starts, stops, strict=False))
    assert d.speaking == (len(kinds) % 2 == 1)


def test_only_the_chunk_that_brings_a_pause_to_a_decision_is_deciding():
    """What makes the session's audio urgent for the speech detector (no batching wait)."""
    d = semantic(ASK)
    feed(d, [0.9])
    verdicts = []
    for _ in range(9):
        verdicts.append(d.deciding(CHUNK))
        feed(d, [0.1])
    # Asked at the 4th chunk of silence, a complete turn may end at the 7th.
    assert verdicts == [False, False, False, True, False, False, True, False, False]
    s = TurnDetector(silence_samples=4 * CHUNK)
    feed(s, [0.9, 0.1, 0.1])
    assert not s.deciding(CHUNK)
    feed(s, [0.1])
    assert s.deciding(CHUNK)
    assert not TurnDetector().deciding(CHUNK)
