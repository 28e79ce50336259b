"""Invariants of the session core under arbitrary command sequences."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex.media.rates import REALTIME_RATE
from duplex.session import (
    AudioReceived,
    Cancel,
    Close,
    InputConsumed,
    InputDropped,
    OutputChunk,
    OutputChunkProduced,
    OutputDelivered,
    PlaybackAcknowledged,
    ResponseCompleted,
    Session,
    SessionError,
    SpeechStarted,
    SpeechStopped,
    StartResponse,
    Tick,
    TranscriptTruncated,
    Truncate,
    VideoFrameReceived,
)

HALF_SECOND = REALTIME_RATE // 2

TRACKS = st.sampled_from(["mic", "camera_audio"])
counts = st.integers(min_value=-5, max_value=5000)

commands = st.one_of(
    st.builds(AudioReceived, TRACKS, counts),
    st.builds(VideoFrameReceived, st.integers(0, 200_000)),
    st.builds(InputConsumed, TRACKS, counts),
    st.builds(InputDropped, TRACKS, counts, st.sampled_from(["overflow", "rate", ""])),
    st.builds(SpeechStarted, st.integers(0, 200_000)),
    st.builds(SpeechStopped, st.integers(0, 200_000)),
    st.just(StartResponse()),
    st.builds(OutputChunkProduced, st.integers(0, 4), counts, st.text(max_size=3)),
    st.builds(ResponseCompleted, st.integers(0, 4)),
    st.builds(PlaybackAcknowledged, st.integers(0, 20_000)),
    st.builds(OutputDelivered, st.integers(0, 20_000)),
    st.builds(Truncate, st.integers(0, 3), st.integers(0, 20_000)),
    st.builds(Cancel, st.sampled_from(["client", "barge_in"])),
    st.builds(Tick, st.integers(0, 200_000)),
)
run_settings = settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def apply(session, command):
    try:
        return session.handle(command)
    except SessionError:
        return None


class Ledger:
    """What the test itself fed into each track and took out of it, counted apart from the
    session, so the session's books can be checked against it."""

    def __init__(self) -> None:
        self.received: dict[str, int] = {}
        self.consumed: dict[str, int] = {}
        self.dropped: dict[str, int] = {}

    def record(self, cmd, events) -> None:
        if events is None:
            return
        if isinstance(cmd, VideoFrameReceived):
            self.received["video"] = self.received.get("video", 0) + 1
            if not events:  # not sampled: the frame is dropped on arrival
                self.dropped["video"] = self.dropped.get("video", 0) + 1
            return
        book = {AudioReceived: self.received, InputConsumed: self.consumed,
                InputDropped: self.dropped}.get(type(cmd))
        if book is not None:
            n = cmd.n_samples if isinstance(cmd, AudioReceived) else cmd.n
            book[cmd.track] = book.get(cmd.track, 0) + n

    def check(self, session) -> None:
        for name in set(self.received) | set(session.tracks):
            track = session.track(name)
            assert track.received == self.received.get(name, 0)
            assert track.consumed == self.consumed.get(name, 0)
            assert track.dropped_total == self.dropped.get(name, 0) + track.dropped.get("closed", 0)
            assert track.buffered == (self.received.get(name, 0) - self.consumed.get(name, 0)
                                      - track.dropped_total) >= 0


def run(session, cmds, ledger):
    for cmd in cmds:
        ledger.record(cmd, apply(session, cmd))
        ledger.check(session)


@run_settings
@given(st.lists(commands, max_size=40))
def test_every_sample_fed_is_consumed_buffered_or_dropped(cmds):
    run(Session("p", video_interval_samples=HALF_SECOND), cmds, Ledger())


@run_settings
@given(st.lists(commands, max_size=40))
def test_playback_never_ahead_of_sent(cmds):
    s = Session("p", video_interval_samples=HALF_SECOND)
    for cmd in cmds:
        apply(s, cmd)
        assert 0 <= s.played_samples <= s.sent_samples
        for response in s.responses:
            # A listener may report hearing more than the server's estimate, never more than
            # it was handed.
            assert response.heard_samples is None or response.heard_samples <= max(
                response.sent_samples, response.delivered_samples)


@run_settings
@given(st.lists(commands, max_size=40))
def test_no_chunk_of_an_old_epoch_after_a_bump(cmds):
    s = Session("p", video_interval_samples=HALF_SECOND)
    for cmd in cmds:
        epoch_before = s.epoch
        events = apply(s, cmd) or []
        for event in events:
            if isinstance(event, OutputChunk):
                assert event.epoch == s.epoch == epoch_before


@run_settings
@given(st.lists(commands, max_size=40))
def test_a_truncate_is_bounded_by_delivery_and_cuts_only_the_last_reply(cmds):
    s = Session("p", video_interval_samples=HALF_SECOND)
    for cmd in cmds:
        delivered = {r.id: r.delivered_samples for r in s.responses}
        on_track = {r.id: r.sent_samples for r in s.responses}
        last = s.responses[-1].id if s.responses else None
        played_before = s.played_samples
        events = apply(s, cmd) or []
        if not isinstance(cmd, Truncate):
            continue
        for event in events:
            assert isinstance(event, TranscriptTruncated)
            response = s.responses[event.response_id]
            assert event.audio_end_sample <= delivered[response.id]
            assert event.heard_text == response.text_before(event.audio_end_sample)
            cut = response.start_sample + event.audio_end_sample
            if response.id == last and event.audio_end_sample < on_track[response.id]:
                assert s.played_samples == s.sent_samples == cut
            else:
                assert s.played_samples == played_before


@run_settings
@given(st.lists(commands, max_size=40))
def test_after_close_nothing_is_held(cmds):
    s = Session("p", video_interval_samples=HALF_SECOND)
    ledger = Ledger()
    run(s, cmds, ledger)
    buffered = {name: t.buffered for name, t in s.tracks.items()}
    s.handle(Close())
    assert all(n == 0 for _, n in s.held())
    ledger.check(s)
    assert {name: t.dropped.get("closed", 0) for name, t in s.tracks.items()} == buffered
    for cmd in cmds[:5]:
        assert apply(s, cmd) is None


@run_settings
@given(st.lists(commands, max_size=40), commands)
def test_a_rejected_command_changes_no_state(cmds, last):
    s = Session("p", video_interval_samples=HALF_SECOND)
    for cmd in cmds:
        apply(s, cmd)
    before = repr(vars(s))
    if apply(s, last) is None:
        assert repr(vars(s)) == before
