"""Speech over a reply pauses it; long speech cancels it, short speech resumes it: the session
core's side of `turn_detection.min_interruption_ms`, under arbitrary command sequences."""

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from duplex.media.rates import REALTIME_RATE
from duplex.session import (
    Cancel,
    EpochBumped,
    Flush,
    InterruptionConfirmed,
    OutputChunk,
    OutputChunkProduced,
    OutputPaused,
    OutputResumed,
    PlaybackAcknowledged,
    ResponseCancelled,
    ResponseCompleted,
    Session,
    SessionError,
    SetInterruption,
    SpeechStarted,
    SpeechStopped,
    StartResponse,
    Truncate,
    TurnState,
    VoiceActivity,
)

HALF_SECOND = REALTIME_RATE // 2

MIN = 9600
GAP = 3840
positions = st.integers(0, 100_000)
commands = st.one_of(
    st.just(StartResponse()),
    st.builds(OutputChunkProduced, st.integers(0, 3), st.integers(0, 4800), st.text(max_size=2)),
    st.builds(ResponseCompleted, st.integers(0, 3)),
    st.builds(PlaybackAcknowledged, st.integers(0, 20_000)),
    st.builds(Truncate, st.integers(0, 2), st.integers(0, 20_000)),
    st.builds(Cancel, st.just("client_cancelled")),
    st.builds(SpeechStarted, positions),
    st.builds(SpeechStopped, positions),
    st.builds(VoiceActivity, positions, st.booleans()),
)
run_settings = settings(max_examples=300, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])


def apply(session, command):
    try:
        return session.handle(command)
    except SessionError:
        return None


def paused_session() -> Session:
    s = Session("p", video_interval_samples=HALF_SECOND)
    s.handle(SetInterruption(MIN, GAP))
    return s


@run_settings
@given(st.lists(commands, max_size=60))
def test_a_pause_holds_the_reply_in_place_until_its_speech_is_judged(cmds):
    s = paused_session()
    for cmd in cmds:
        before = (s.epoch, s.sent_samples, s.played_samples,
                  [r.sent_samples for r in s.responses], s.pause)
        events = apply(s, cmd) or []
        kinds = {type(e) for e in events}
        if OutputPaused in kinds:
            # Pausing is not cancelling: nothing is bumped, flushed or cut.
            assert not kinds & {EpochBumped, Flush, ResponseCancelled}
            assert (s.epoch, s.sent_samples, s.played_samples) == before[:3]
            assert [r.sent_samples for r in s.responses] == before[3]
            assert s.pause is not None and s.turn is TurnState.USER_SPEAKING
        if EpochBumped in kinds:
            # Only a client's cancel or speech that lasted cuts a reply.
            assert isinstance(cmd, Cancel | Truncate) or InterruptionConfirmed in kinds
        for e in events:
            if isinstance(e, OutputResumed):
                assert before[4] is not None and s.pause is None
                assert e.speech_end - e.onset < MIN
                if isinstance(cmd, VoiceActivity):
                    assert cmd.end_sample - e.onset >= MIN
                    assert cmd.end_sample - e.speech_end >= GAP
                assert s.turn in (TurnState.RESPONDING, TurnState.LISTENING)
            if isinstance(e, InterruptionConfirmed):
                assert before[4] is not None and s.pause is None
                assert e.onset == before[4].onset
                # Speech that lasted, or a new reply that supersedes the paused one.
                if not isinstance(cmd, StartResponse):
                    reached = (cmd.end_sample if isinstance(cmd, VoiceActivity)
                               else cmd.at_sample)
                    assert reached - e.onset >= MIN


@run_settings
@given(st.lists(commands, max_size=60))
# A client's new reply while speech holds a cancelled one paused: the pause is judged then.
@example([StartResponse(), SpeechStarted(0), Cancel("client_cancelled"), StartResponse(),
          SpeechStarted(0)])
def test_every_pause_is_judged_once_and_counted(cmds):
    s = paused_session()
    paused = confirmed = resumed = 0
    for cmd in cmds:
        for e in apply(s, cmd) or []:
            paused += isinstance(e, OutputPaused)
            confirmed += isinstance(e, InterruptionConfirmed)
            resumed += isinstance(e, OutputResumed)
        assert paused == confirmed + resumed + (s.pause is not None)
        assert (s.interruptions, s.false_interruptions) == (confirmed, resumed)


@run_settings
@given(st.lists(commands, max_size=60))
def test_no_reply_audio_while_paused_belongs_to_an_old_epoch(cmds):
    s = paused_session()
    for cmd in cmds:
        for e in apply(s, cmd) or []:
            if isinstance(e, OutputChunk):
                assert e.epoch == s.epoch


def test_without_a_minimum_speech_over_a_reply_cancels_at_once():
    s = Session("p", video_interval_samples=HALF_SECOND)
    s.handle(StartResponse())
    s.handle(OutputChunkProduced(0, 2400))
    events = s.handle(SpeechStarted(100))
    kinds = [type(e) for e in events]
    assert EpochBumped in kinds and ResponseCancelled in kinds and InterruptionConfirmed in kinds
    assert OutputPaused not in kinds and s.interruptions == 1


def test_a_cough_resumes_the_reply_and_a_sentence_cancels_it():
    s = paused_session()
    s.handle(StartResponse())
    s.handle(OutputChunkProduced(0, 4800, "hello "))
    assert [type(e) for e in s.handle(SpeechStarted(1000))][0] is OutputPaused
    s.handle(VoiceActivity(1000 + 3000, True))
    # Quiet long enough, but judged only once the minimum has passed since the onset.
    assert s.handle(VoiceActivity(1000 + 3000 + GAP, False)) == []
    resumed = s.handle(VoiceActivity(1000 + MIN, False))
    assert resumed[-1] == OutputResumed(0, 1000, 4000)
    assert s.turn is TurnState.RESPONDING and s.epoch == 0 and s.sent_samples == 4800

    s.handle(SpeechStarted(20_000))
    s.handle(VoiceActivity(20_000 + MIN - 1, True))
    assert s.epoch == 0
    events = s.handle(VoiceActivity(20_000 + MIN, True))
    assert {type(e) for e in events} >= {EpochBumped, ResponseCancelled, InterruptionConfirmed}
    assert s.epoch == 1 and (s.interruptions, s.false_interruptions) == (1, 1)
