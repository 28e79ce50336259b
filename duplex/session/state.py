"""The session state machine: timeline, turn state, epochs, playback watermark, close.

`Session.handle(command)` validates the whole command before it changes anything, so a
command that raises a `SessionError` leaves the session exactly as it was.
"""

from dataclasses import dataclass, field
from enum import StrEnum

from duplex.session import commands as c
from duplex.session import events as e
from duplex.session.errors import (
    AckBeyondSent,
    InvalidCommand,
    NoActiveResponse,
    SessionClosed,
    UnknownCommand,
)
from duplex.session.timeline import TrackCounters, require_count

VIDEO = "video"


class TurnState(StrEnum):
    LISTENING = "listening"
    USER_SPEAKING = "user_speaking"
    RESPONDING = "responding"
    CLOSED = "closed"


@dataclass
class Response:
    """One assistant reply as placed on the output track, with the text spoken in each chunk."""

    id: int
    epoch: int
    start_sample: int
    sent_samples: int = 0
    generating: bool = True
    pieces: list[tuple[int, str]] = field(default_factory=list)
    heard_samples: int | None = None
    delivered_samples: int = 0
    """Samples of this reply handed to the listener's carrier. The server's playback estimate
    can lag what a client really played; a client may report hearing anything up to this."""

    def text_before(self, audio_end: int) -> str:
        """The text whose audio started before `audio_end` (relative to the response start)."""
        return "".join(text for offset, text in self.pieces if offset < audio_end)

    @property
    def transcript(self) -> str:
        if self.heard_samples is None:
            return "".join(text for _, text in self.pieces)
        return self.text_before(self.heard_samples)


@dataclass
class Pause:
    """Speech that began over a reply at input sample `onset`, not yet judged: the reply's
    output is held meanwhile."""

    response_id: int
    onset: int
    speech_end: int
    """End of the last chunk the detector scored as speech."""


class Session:
    def __init__(
        self,
        session_id: str,
        *,
        video_interval_samples: int,
    ) -> None:
        require_count("video_interval_samples", video_interval_samples, positive=True)
        self.id = session_id
        self.video_interval_samples = video_interval_samples
        self.tracks: dict[str, TrackCounters] = {}
        self.turn = TurnState.LISTENING
        self.epoch = 0
        self.next_seq = 0
        self.sent_samples = 0
        self.played_samples = 0
        self.flushed_samples = 0
        self.responses: list[Response] = []
        self.now_sample = 0
        self.speech_start: int | None = None
        self.last_video_pts: int | None = None
        self.min_interruption_samples = 0
        self.resume_gap_samples = 0
        self.pause: Pause | None = None
        self.interruptions = 0
        """Replies cut by the user's speech."""
        self.false_interruptions = 0
        """Pauses whose speech was too short to cut the reply, which went on."""

    # -- derived views -------------------------------------------------------------------

    def track(self, name: str) -> TrackCounters:
        return self.tracks.get(name) or TrackCounters()

    @property
    def active_response(self) -> Response | None:
        if self.responses and self.responses[-1].generating:
            return self.responses[-1]
        return None

    @property
    def unplayed_samples(self) -> int:
        return self.sent_samples - self.played_samples

    def held(self) -> tuple[tuple[str, int], ...]:
        """What the session holds now, by name: buffered input, unplayed output, history."""
        items = [(f"input:{name}", t.buffered) for name, t in sorted(self.tracks.items())]
        items.append(("output:unplayed_samples", self.unplayed_samples))
        items.append(("responses", len(self.responses)))
        return tuple(items)

    # -- the one entry point -------------------------------------------------------------

    def handle(self, command: object) -> list[e.Event]:
        handler = _HANDLERS.get(type(command))
        if handler is None:
            raise UnknownCommand(f"unknown command {type(command).__name__}")
        if self.turn is TurnState.CLOSED:
            raise SessionClosed(f"session {self.id} is closed; {type(command).__name__} refused")
        return handler(self, command)

    # -- input ---------------------------------------------------------------------------

    def _audio_received(self, cmd: c.AudioReceived) -> list[e.Event]:
        _require_track(cmd.track)
        n = require_count("n_samples", cmd.n_samples)
        self.tracks.setdefault(cmd.track, TrackCounters()).receive(n)
        return []

    def _video_frame(self, cmd: c.VideoFrameReceived) -> list[e.Event]:
        pts = require_count("pts_sample", cmd.pts_sample)
        video = self.tracks.setdefault(VIDEO, TrackCounters())
        video.receive(1)
        if self.last_video_pts is not None and pts - self.last_video_pts < self.video_interval_samples:
            video.drop(1, "not_sampled")
            return []
        self.last_video_pts = pts
        return [e.VideoFrameSampled(pts)]

    def _input_consumed(self, cmd: c.InputConsumed) -> list[e.Event]:
        _require_track(cmd.track)
        n = require_count("n", cmd.n)
        self.track(cmd.track).check_take(n)
        if n:
            self.tracks[cmd.track].consume(n)
        return []

    def _input_dropped(self, cmd: c.InputDropped) -> list[e.Event]:
        _require_track(cmd.track)
        n = require_count("n", cmd.n)
        if not isinstance(cmd.reason, str) or not cmd.reason:
            raise InvalidCommand("a drop needs a non-empty reason")
        self.track(cmd.track).check_take(n)
        if n:
            self.tracks[cmd.track].drop(n, cmd.reason)
        return []

    # -- turns ---------------------------------------------------------------------------

    def _set_interruption(self, cmd: c.SetInterruption) -> list[e.Event]:
        self.min_interruption_samples = require_count("min_samples", cmd.min_samples)
        self.resume_gap_samples = require_count("resume_gap_samples", cmd.resume_gap_samples)
        return []

    @property
    def _playing(self) -> bool:
        return self.turn is TurnState.RESPONDING or bool(self.unplayed_samples)

    def _speech_started(self, cmd: c.SpeechStarted) -> list[e.Event]:
        at = require_count("at_sample", cmd.at_sample)
        if self.turn is TurnState.USER_SPEAKING:
            return []
        out: list[e.Event] = []
        if self._playing and self.min_interruption_samples:
            # Pausing costs nothing if the speech turns out to be a cough: it happens at once,
            # and the judgement waits for the speech to last (or not).
            rid = self.responses[-1].id
            self.pause = Pause(rid, at, at)
            out.append(e.OutputPaused(rid, at))
        elif self._playing:
            out += self._cancel_response("barge_in")
            self.interruptions += 1
            out.append(e.InterruptionConfirmed(at))
        self.speech_start = at
        out.append(self._set_turn(TurnState.USER_SPEAKING))
        return out

    def _voice_activity(self, cmd: c.VoiceActivity) -> list[e.Event]:
        end = require_count("end_sample", cmd.end_sample)
        if type(cmd.speech) is not bool:
            raise InvalidCommand("speech must be a bool")
        pause = self.pause
        if pause is None or end <= pause.onset:
            return []
        if cmd.speech:
            pause.speech_end = max(pause.speech_end, end)
            if end - pause.onset >= self.min_interruption_samples:
                return self._confirm()
            return []
        # Judged no sooner than the minimum: speech has pauses of its own (between syllables,
        # or as the detector hears its onset), and a reply resumed in one would stop again.
        if (end - pause.onset >= self.min_interruption_samples
                and end - pause.speech_end >= self.resume_gap_samples):
            return self._resume()
        return []

    def _confirm(self) -> list[e.Event]:
        """The paused speech lasted: it cuts the reply, as a barge-in always did."""
        pause, self.pause = self.pause, None
        out: list[e.Event] = []
        if self._playing:
            out += self._cancel_response("barge_in")
        self.interruptions += 1
        out.append(e.InterruptionConfirmed(pause.onset))
        return out

    def _resume(self) -> list[e.Event]:
        """A false interruption: the speech ended too soon; the reply goes on where it paused."""
        pause, self.pause = self.pause, None
        self.false_interruptions += 1
        self.speech_start = None
        turn = TurnState.RESPONDING if self.active_response is not None else TurnState.LISTENING
        return [self._set_turn(turn),
                e.OutputResumed(pause.response_id, pause.onset, pause.speech_end)]

    def _speech_stopped(self, cmd: c.SpeechStopped) -> list[e.Event]:
        at = require_count("at_sample", cmd.at_sample)
        if self.turn is not TurnState.USER_SPEAKING:
            return []
        start = self.speech_start if self.speech_start is not None else at
        if at < start:
            raise InvalidCommand(f"speech stopped at {at}, before it started at {start}")
        out: list[e.Event] = []
        if self.pause is not None:
            if at - self.pause.onset < self.min_interruption_samples:
                return self._resume()
            out += self._confirm()
        self.speech_start = None
        return [*out, self._set_turn(TurnState.LISTENING), e.UserTurnEnded(start, at)]

    def _start_response(self, _cmd: c.StartResponse) -> list[e.Event]:
        if self.active_response is not None:
            raise InvalidCommand(f"response {self.active_response.id} is already in progress")
        out: list[e.Event] = []
        if self.pause is not None:
            # A new reply while speech holds an old one paused: the old one will not resume,
            # so the speech has cut it (judged now, or its audio would sit before the new).
            out += self._confirm()
        response = Response(id=len(self.responses), epoch=self.epoch, start_sample=self.sent_samples)
        self.responses.append(response)
        if self.turn is not TurnState.RESPONDING:
            out.append(self._set_turn(TurnState.RESPONDING))
        out.append(e.ResponseStarted(response.id, self.epoch, response.start_sample))
        return out

    # -- output --------------------------------------------------------------------------

    def _output_chunk(self, cmd: c.OutputChunkProduced) -> list[e.Event]:
        epoch = require_count("epoch", cmd.epoch)
        n = require_count("n_samples", cmd.n_samples)
        if not isinstance(cmd.text, str):
            raise InvalidCommand("chunk text must be a str")
        if epoch > self.epoch:
            raise InvalidCommand(f"chunk epoch {epoch} is ahead of the session's {self.epoch}")
        response = self.active_response
        if epoch < self.epoch or response is None or response.epoch != epoch:
            reason = "stale_epoch" if epoch < self.epoch else "no_active_response"
            return [e.ChunkRefused(epoch, self.epoch, n, reason)]
        chunk = e.OutputChunk(
            epoch=epoch,
            seq=self.next_seq,
            start_sample=self.sent_samples,
            n_samples=n,
            response_id=response.id,
            text=cmd.text,
        )
        if cmd.text:
            response.pieces.append((response.sent_samples, cmd.text))
        response.sent_samples += n
        self.sent_samples += n
        self.next_seq += 1
        return [chunk]

    def _response_completed(self, cmd: c.ResponseCompleted) -> list[e.Event]:
        epoch = require_count("epoch", cmd.epoch)
        response = self.active_response
        if epoch < self.epoch or response is None or response.epoch != epoch:
            return []
        response.generating = False
        out: list[e.Event] = [e.ResponseDone(response.id, epoch, response.sent_samples)]
        if self.turn is TurnState.RESPONDING:
            out.append(self._set_turn(TurnState.LISTENING))
        return out

    def _output_delivered(self, cmd: c.OutputDelivered) -> list[e.Event]:
        end = require_count("end_sample", cmd.end_sample)
        if end > self.sent_samples:
            raise AckBeyondSent(f"delivery up to {end} is beyond the {self.sent_samples} samples sent")
        response = self.responses[-1] if self.responses else None
        if response is not None and end > response.start_sample:
            response.delivered_samples = max(
                response.delivered_samples, min(end - response.start_sample, response.sent_samples)
            )
        return []

    def _playback_ack(self, cmd: c.PlaybackAcknowledged) -> list[e.Event]:
        played = require_count("played_sample", cmd.played_sample)
        if played > self.sent_samples:
            raise AckBeyondSent(f"ack at {played} is beyond the {self.sent_samples} samples sent")
        # Acks race newer output; the watermark only moves forward.
        self.played_samples = max(self.played_samples, played)
        return []

    def _truncate(self, cmd: c.Truncate) -> list[e.Event]:
        rid = require_count("response_id", cmd.response_id)
        end = require_count("audio_end_sample", cmd.audio_end_sample)
        if rid >= len(self.responses):
            raise NoActiveResponse(f"no response {rid} to truncate")
        response = self.responses[rid]
        if end > response.delivered_samples:
            raise AckBeyondSent(
                f"audio_end {end} is beyond the {response.delivered_samples} samples delivered "
                f"in response {rid}"
            )
        response.heard_samples = end
        if response is self.responses[-1] and end < response.sent_samples:
            # The listener stopped playing there: the rest of the reply leaves the output track.
            cut = response.start_sample + end
            self.flushed_samples += self.sent_samples - cut
            response.sent_samples = end
            self.sent_samples = cut
            self.played_samples = cut
        return [e.TranscriptTruncated(rid, end, response.transcript)]

    # -- cancellation and close ----------------------------------------------------------

    def _cancel(self, cmd: c.Cancel) -> list[e.Event]:
        if not isinstance(cmd.reason, str) or not cmd.reason:
            raise InvalidCommand("a cancel needs a non-empty reason")
        out = self._cancel_response(cmd.reason)
        if self.turn is TurnState.RESPONDING:
            out.append(self._set_turn(TurnState.LISTENING))
        return out

    def _cancel_response(self, reason: str) -> list[e.Event]:
        """Bump the epoch, flush queued output, and keep only the heard part of the reply."""
        old = self.epoch
        self.epoch += 1
        out: list[e.Event] = [e.EpochBumped(old, self.epoch, reason), e.Flush(old)]
        response = self.responses[-1] if self.responses else None
        if response is not None and not response.generating and not self.unplayed_samples:
            response = None
        # Output nobody heard never joins the output track: it falls back to the watermark.
        self.flushed_samples += self.unplayed_samples
        self.sent_samples = self.played_samples
        if response is not None:
            response.generating = False
            heard = max(0, min(self.played_samples - response.start_sample, response.sent_samples))
            response.heard_samples = heard
            response.sent_samples = heard
            out.append(e.TranscriptTruncated(response.id, heard, response.transcript))
            out.append(e.ResponseCancelled(response.id, old, reason, heard))
        return out

    def _tick(self, cmd: c.Tick) -> list[e.Event]:
        now = require_count("now_sample", cmd.now_sample)
        if now < self.now_sample:
            raise InvalidCommand(f"clock went back from {self.now_sample} to {now}")
        self.now_sample = now
        return []

    def _close(self, cmd: c.Close) -> list[e.Event]:
        held = self.held()
        for track in self.tracks.values():
            track.drop(track.buffered, "closed")
        self.flushed_samples += self.unplayed_samples
        self.sent_samples = self.played_samples
        self.responses.clear()
        self.pause = None
        old = self.turn
        self.turn = TurnState.CLOSED
        return [e.TurnChanged(old, TurnState.CLOSED), e.Released(held)]

    def _set_turn(self, new: TurnState) -> e.TurnChanged:
        old, self.turn = self.turn, new
        return e.TurnChanged(old, new)


def _require_track(track: object) -> None:
    if not isinstance(track, str) or not track:
        raise InvalidCommand("track must be a non-empty str")


_HANDLERS = {
    c.AudioReceived: Session._audio_received,
    c.VideoFrameReceived: Session._video_frame,
    c.InputConsumed: Session._input_consumed,
    c.InputDropped: Session._input_dropped,
    c.SpeechStarted: Session._speech_started,
    c.SpeechStopped: Session._speech_stopped,
    c.VoiceActivity: Session._voice_activity,
    c.SetInterruption: Session._set_interruption,
    c.StartResponse: Session._start_response,
    c.OutputChunkProduced: Session._output_chunk,
    c.ResponseCompleted: Session._response_completed,
    c.OutputDelivered: Session._output_delivered,
    c.PlaybackAcknowledged: Session._playback_ack,
    c.Truncate: Session._truncate,
    c.Cancel: Session._cancel,
    c.Close: Session._close,
    c.Tick: Session._tick,
}
