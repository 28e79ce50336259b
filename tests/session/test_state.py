import pytest

from duplex.media.rates import REALTIME_RATE
from duplex.session import (
    AckBeyondSent,
    AudioReceived,
    Cancel,
    ChunkRefused,
    Close,
    EpochBumped,
    Flush,
    InputConsumed,
    InputDropped,
    InvalidCommand,
    NoActiveResponse,
    OutputChunk,
    OutputChunkProduced,
    OutputDelivered,
    PlaybackAcknowledged,
    Released,
    ResponseCancelled,
    ResponseCompleted,
    ResponseDone,
    Session,
    SessionClosed,
    SpeechStarted,
    SpeechStopped,
    StartResponse,
    Tick,
    TranscriptTruncated,
    Truncate,
    TurnState,
    UnknownCommand,
    UserTurnEnded,
    VideoFrameReceived,
    VideoFrameSampled,
)

HALF_SECOND = REALTIME_RATE // 2


def responding_session() -> Session:
    s = Session("s1", video_interval_samples=HALF_SECOND)
    s.handle(AudioReceived("mic", 4800))
    s.handle(SpeechStarted(0))
    s.handle(SpeechStopped(4800))
    s.handle(StartResponse())
    return s


def test_input_accounting_per_track():
    s = Session("s1", video_interval_samples=HALF_SECOND)
    s.handle(AudioReceived("mic", 960))
    s.handle(AudioReceived("mic", 480))
    s.handle(InputConsumed("mic", 1000))
    s.handle(InputDropped("mic", 100, "overflow"))
    t = s.track("mic")
    assert (t.received, t.consumed, t.buffered, t.dropped) == (1440, 1000, 340, {"overflow": 100})


def test_user_turn_and_response_flow():
    s = Session("s1", video_interval_samples=HALF_SECOND)
    assert s.handle(SpeechStarted(100))[-1].new == TurnState.USER_SPEAKING
    events = s.handle(SpeechStopped(2500))
    assert events[-1] == UserTurnEnded(100, 2500)
    assert s.turn is TurnState.LISTENING
    events = s.handle(StartResponse())
    assert s.turn is TurnState.RESPONDING
    chunk = s.handle(OutputChunkProduced(0, 1920, "Hello"))[0]
    assert chunk == OutputChunk(epoch=0, seq=0, start_sample=0, n_samples=1920, response_id=0, text="Hello")
    chunk2 = s.handle(OutputChunkProduced(0, 1920, " there"))[0]
    assert (chunk2.seq, chunk2.start_sample) == (1, 1920)
    done = s.handle(ResponseCompleted(0))
    assert done[0] == ResponseDone(0, 0, 3840)
    assert s.turn is TurnState.LISTENING


def test_barge_in_bumps_epoch_flushes_and_truncates_at_watermark():
    s = responding_session()
    s.handle(OutputChunkProduced(0, 1920, "one "))
    s.handle(OutputChunkProduced(0, 1920, "two "))
    s.handle(OutputChunkProduced(0, 1920, "three"))
    s.handle(PlaybackAcknowledged(2000))
    events = s.handle(SpeechStarted(9000))
    assert EpochBumped(0, 1, "barge_in") in events
    assert Flush(0) in events
    assert ResponseCancelled(0, 0, "barge_in", 2000) in events
    assert TranscriptTruncated(0, 2000, "one two ") in events
    assert s.turn is TurnState.USER_SPEAKING
    assert s.sent_samples == s.played_samples == 2000
    assert s.flushed_samples == 3760


def test_chunks_of_an_old_epoch_are_refused():
    s = responding_session()
    s.handle(Cancel("client_cancel"))
    events = s.handle(OutputChunkProduced(0, 1920, "late"))
    assert events == [ChunkRefused(0, 1, 1920, "stale_epoch")]
    assert s.sent_samples == 0


def test_new_response_after_cancel_is_accepted_in_new_epoch():
    s = responding_session()
    s.handle(Cancel("client_cancel"))
    s.handle(StartResponse())
    [chunk] = s.handle(OutputChunkProduced(1, 960))
    assert (chunk.epoch, chunk.response_id) == (1, 1)


def test_explicit_truncate_cuts_the_reply_where_the_listener_stopped():
    s = responding_session()
    s.handle(OutputChunkProduced(0, 1920, "a"))
    s.handle(OutputChunkProduced(0, 1920, "b"))
    s.handle(ResponseCompleted(0))
    s.handle(OutputDelivered(3840))
    events = s.handle(Truncate(0, 1000))
    assert events == [TranscriptTruncated(0, 1000, "a")]
    assert s.played_samples == s.sent_samples == 1000
    assert s.flushed_samples == 2840


def test_a_truncate_past_the_servers_estimate_but_within_delivery_is_the_listeners_truth():
    """A client played more than the server's playback estimate when speech began (its
    buffer ran ahead of the estimate): it is right, up to what it was handed."""
    s = responding_session()
    for text in ("one ", "two ", "three"):
        s.handle(OutputChunkProduced(0, 1920, text))
    s.handle(OutputDelivered(5760))
    s.handle(PlaybackAcknowledged(2000))
    s.handle(SpeechStarted(9000))
    assert s.responses[0].transcript == "one two "
    [truncated] = s.handle(Truncate(0, 4000))
    assert truncated == TranscriptTruncated(0, 4000, "one two three")
    assert s.sent_samples == s.played_samples == 2000
    with pytest.raises(AckBeyondSent, match="5760 samples delivered"):
        s.handle(Truncate(0, 5761))


def test_a_truncate_beyond_what_was_delivered_is_refused():
    s = responding_session()
    s.handle(OutputChunkProduced(0, 1920, "a"))
    s.handle(OutputChunkProduced(0, 1920, "b"))
    s.handle(OutputDelivered(1920))
    with pytest.raises(AckBeyondSent):
        s.handle(Truncate(0, 1921))
    assert s.responses[0].heard_samples is None


def test_video_frames_sampled_by_timestamp():
    s = Session("s1", video_interval_samples=HALF_SECOND)
    sampled = [bool(s.handle(VideoFrameReceived(pts))) for pts in range(0, 48000, 4000)]
    assert sampled == [True, False, False] * 4
    assert s.handle(VideoFrameReceived(48000)) == [VideoFrameSampled(48000)]
    v = s.track("video")
    assert (v.received, v.buffered, v.dropped) == (13, 5, {"not_sampled": 8})


def test_close_releases_everything_and_refuses_later_commands():
    s = responding_session()
    s.handle(OutputChunkProduced(0, 1920, "x"))
    events = s.handle(Close())
    released = events[-1]
    assert isinstance(released, Released)
    assert dict(released.items) == {
        "input:mic": 4800,
        "output:unplayed_samples": 1920,
        "responses": 1,
    }
    assert s.track("mic").buffered == 0 and s.track("mic").dropped == {"closed": 4800}
    assert s.unplayed_samples == 0 and s.responses == []
    with pytest.raises(SessionClosed):
        s.handle(AudioReceived("mic", 1))


@pytest.mark.parametrize(
    "command, error",
    [
        (AudioReceived("mic", -1), InvalidCommand),
        (AudioReceived("mic", 1.5), InvalidCommand),
        (AudioReceived("mic", True), InvalidCommand),
        (AudioReceived("", 10), InvalidCommand),
        (InputConsumed("mic", 5000), InvalidCommand),
        (InputDropped("mic", 1, ""), InvalidCommand),
        (PlaybackAcknowledged(1921), AckBeyondSent),
        (Truncate(0, 1921), AckBeyondSent),
        (Truncate(7, 0), NoActiveResponse),
        (OutputChunkProduced(5, 10), InvalidCommand),
        (StartResponse(), InvalidCommand),
        (Tick(-5), InvalidCommand),
        ("session.update", UnknownCommand),
        (object(), UnknownCommand),
    ],
)
def test_bad_commands_raise_typed_errors_and_change_nothing(command, error):
    s = responding_session()
    s.handle(OutputChunkProduced(0, 1920, "x"))
    before = repr(vars(s))
    with pytest.raises(error) as info:
        s.handle(command)
    assert info.value.code == error.code
    assert repr(vars(s)) == before


def test_ack_never_moves_watermark_back():
    s = responding_session()
    s.handle(OutputChunkProduced(0, 1920))
    s.handle(PlaybackAcknowledged(1500))
    s.handle(PlaybackAcknowledged(900))
    assert s.played_samples == 1500


def test_speech_after_completed_but_unplayed_reply_still_interrupts():
    s = responding_session()
    s.handle(OutputChunkProduced(0, 3840, "all of it"))
    s.handle(ResponseCompleted(0))
    s.handle(PlaybackAcknowledged(1000))
    events = s.handle(SpeechStarted(10000))
    assert Flush(0) in events
    assert TranscriptTruncated(0, 1000, "all of it") in events
