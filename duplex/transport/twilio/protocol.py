"""Twilio Media Streams as a pure state machine around the session core.

Text frames from Twilio in (`receive_text`), engine results and VAD probabilities in, and out
come plain effects: messages to send, work for the engine, audio for the VAD, rejections and
DTMF digits to log and count, a close. The asyncio edge (ws.py) carries them out; nothing here
awaits, sleeps or touches a socket. Time enters only as the sample count the edge passes to
`release_output`, which paces reply audio.

The session clock is the wire's own 8 kHz: one mu-law byte is one sample, so inbound
accounting, output frames (160 samples = 20 ms), marks and the playback watermark are exact
integer counts with no resampling of the clock itself.

Playback truth comes from Twilio: every piece of reply audio sent is followed by a `mark`, and
Twilio echoes it once the audio queued before it has played. Only echoed marks move the
watermark, so a barge-in keeps exactly the transcript of the audio the caller heard. Twilio also
echoes the marks a `clear` dropped; those were sent before that clear and move nothing.

Speech over a reply pauses it, and the `clear` goes at once, at the pause: what the phone
holds stops then, not once the speech has lasted long enough to be judged an interruption. If
it was not one (a cough), the reply is sent again from where the caller's playback stood when
the clear went: the last echoed mark, plus the time since its echo came (no further than
continuous playback of what was sent could reach). Nothing is lost, and what plays while the
clear is on its way, and while the mark's echo was, is heard twice: the round trip to Twilio.

Native duplex (`Options.duplex`, from the model's duplex.default_mode): the call is one
always-open reply on the core, and every output frame of the model, silence included, goes to
Twilio as it comes (the caller's phone plays on its own clock); caller speech is only noted.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
from pydantic import ValidationError

from duplex.media import float_to_g711, g711_to_float
from duplex.media.echo import STRENGTHS
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.session.turn_detection import (
    EAGERNESS_WAIT_MS,
    SEMANTIC_ASK_MS,
    SEMANTIC_PAUSE_MS,
    ScoreTurn,
    TurnDetector,
)
from duplex.transport.core import MediaClock, json_object
from duplex.transport.effects import (
    CloseConnection,
    EngineCancel,
    EngineCommit,
    EnginePush,
    EngineSetDuplex,
    InterruptionJudged,
    ScoreTurnEnd,
    Send,
    TurnEnded,
    VadFeed,
)
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.twilio import schema
from duplex.transport.twilio.realtime_view import Publish, RealtimeView

RATE = 8000
"""Twilio's mu-law rate, and so the session clock's."""
FRAME = 160
"""Samples (and mu-law bytes) in one 20 ms media message."""
INPUT_TRACK = "inbound"
MULAW_SILENCE = 0xFF

REJECT_REASONS = (
    "binary_frame",
    "invalid_json",
    "unknown_event",
    "malformed",
    "before_start",
    "duplicate_start",
    "unsupported_format",
    "wrong_stream",
    "out_of_order",
    "bad_base64",
    "wrong_track",
    "unknown_mark",
)
"""Why a message was refused; stable, as they label the rejection metric."""


# -- effects beyond the Realtime ones --------------------------------------------------------


@dataclass(frozen=True)
class Rejected:
    reason: str
    message: str


@dataclass(frozen=True)
class DtmfReceived:
    digit: str


@dataclass(frozen=True)
class BargedIn:
    """The caller talked over a reply and it was cut now (its audio cleared at the pause, or
    now if nothing paused it first)."""

    onset_sample: int
    """Where the speech began on the session clock."""


@dataclass(frozen=True)
class StreamStarted:
    """The stream has started: the call's ids, which sidebands attach by."""

    call_sid: str
    stream_sid: str


@dataclass(frozen=True)
class Notice:
    """Something worth a log line: call start, turn decisions, response outcomes."""

    message: str


Effect = (
    Send | EnginePush | EngineCommit | EngineCancel | VadFeed | CloseConnection
    | Rejected | DtmfReceived | BargedIn | Notice | EngineSetDuplex | InterruptionJudged
    | ScoreTurnEnd | TurnEnded | StreamStarted | Publish
)


@dataclass(frozen=True)
class Options:
    output_lead_ms: int = 200
    """Reply audio is sent at most this far ahead of the estimated playback position."""
    end_call_digit: str = ""
    """A DTMF digit that ends the call; empty for none."""
    vad_threshold: float = 0.5
    turn_detection: str = "semantic_vad"
    """semantic_vad: at a 200 ms pause the end-of-turn model judges whether the caller has
    finished, and `eagerness`'s longest wait ends the turn if it never says so; server_vad:
    `silence_ms` of silence ends it."""
    eagerness: str = "auto"
    silence_ms: int = 500
    """server_vad's silence after speech that ends the caller's turn."""
    prefix_padding_ms: int = 300
    """The model hears a turn from its speech onset less this."""
    turn_model: bool = False
    """The server has the end-of-turn model (without it semantic_vad falls back to server_vad)."""
    duplex: bool = False
    """Run the call natively full duplex (a model with a duplex mode), not turn by turn."""
    min_interruption_ms: int = 400
    """Speech over a reply pauses it; only speech this long cancels it (0: at once)."""
    resume_gap_ms: int = 200
    """Quiet after a paused reply's speech that ends it as a false interruption."""
    noise_reduction: str | None = None
    """The echo guard's strength: None, near_field or far_field (duplex.media.echo)."""

    def detector(self) -> TurnDetector:
        semantic = self.turn_detection == "semantic_vad" and self.turn_model
        wait_ms = EAGERNESS_WAIT_MS[self.eagerness] if semantic else self.silence_ms
        return TurnDetector(threshold=self.vad_threshold,
                            silence_samples=wait_ms * RATE // 1000,
                            prefix_samples=self.prefix_padding_ms * RATE // 1000,
                            pause_samples=SEMANTIC_PAUSE_MS * RATE // 1000 if semantic else None,
                            ask_samples=SEMANTIC_ASK_MS * RATE // 1000 if semantic else None)

    def __post_init__(self) -> None:
        if self.turn_detection not in ("semantic_vad", "server_vad"):
            raise ValueError(f"turn_detection must be semantic_vad or server_vad, "
                             f"not {self.turn_detection!r}")
        if self.eagerness not in EAGERNESS_WAIT_MS:
            raise ValueError(f"eagerness must be one of {list(EAGERNESS_WAIT_MS)}, "
                             f"not {self.eagerness!r}")
        if self.noise_reduction not in STRENGTHS:
            raise ValueError(f"noise_reduction must be one of {list(STRENGTHS)}, "
                             f"not {self.noise_reduction!r}")


@dataclass
class Reply:
    epoch: int
    engine_done: bool = False


@dataclass(frozen=True)
class SentMark:
    epoch: int
    end: int
    """The output sample the mark follows."""
    clears: int
    """Clears sent before it: the echo of a mark sent before the latest clear says nothing of
    what played (Twilio echoes the marks a clear drops at once)."""


def mark_name(chunk: ev.OutputChunk, n: int) -> str:
    """The `n`th mark of the call, after a piece of `chunk`'s audio."""
    return f"duplex.r{chunk.response_id}.e{chunk.epoch}.m{n}"


class TwilioProtocol:
    def __init__(
        self,
        session_id: str,
        *,
        model_input_rate: int,
        model_output_rate: int,
        options: Options | None = None,
        model: str = "",
    ) -> None:
        self.options = options or Options()
        self.clock = MediaClock(
            session_id, rate=RATE, model_input_rate=model_input_rate,
            model_output_rate=model_output_rate,
            lead_samples=self.options.output_lead_ms * RATE // 1000,
            detector=self.options.detector(),
            resends=True,
        )
        self.core = self.clock.core
        self.pacer = self.clock.pacer
        o = self.options
        self.core.handle(cmd.SetInterruption(o.min_interruption_ms * RATE // 1000,
                                             o.resume_gap_ms * RATE // 1000))
        self.clock.guard.set_strength(o.noise_reduction)
        self.clock.gate.enabled = True
        self.stream: schema.StartBody | None = None
        self.last_seq = 0
        self.reply: Reply | None = None
        self._pending = np.zeros(0, np.float32)
        """Reply audio at 8 kHz short of a whole frame, waiting for more."""
        self._pending_text = ""
        self.marks: dict[str, SentMark] = {}
        """Marks sent and not yet echoed, by name."""
        self.marks_sent = 0
        self.clears = 0
        self._echoed_at: int | None = None
        """Clock sample at which the latest echo that moved the watermark came."""
        self._echo_untimed = False
        """An echo moved the watermark since the last release_output: it came at its `now`."""
        self._resend = False
        """A clear went at a pause: the next release_output resends from where playback was."""
        self.rejected: dict[str, int] = {}
        self.digits: list[str] = []
        self.closed = False
        self.duplex = False
        self.duplex_dropped: dict[str, int] = {}
        semantic = o.turn_detection == "semantic_vad" and o.turn_model
        self.view = RealtimeView(session_id, model, "duplex" if o.duplex else
                                 "semantic_vad" if semantic else "server_vad")
        """The call as its sidebands see it (realtime_view.py)."""
        self._sideband_handlers: dict[str, Callable[[Any, list[Effect]], None]] = {
            "session.update": self.view.update,
            "response.create": self._sideband_response,
            "conversation.item.create": self.view.item,
            "response.cancel": self._sideband_cancel,
        }

    # -- entry points ---------------------------------------------------------------------

    def receive_bytes(self, data: bytes) -> list[Effect]:
        out: list[Effect] = []
        self._reject(out, "binary_frame", f"binary frame of {len(data)} bytes; Twilio sends JSON text")
        return out

    def receive_text(self, text: str) -> list[Effect]:
        out: list[Effect] = []
        if self.closed:
            return out
        raw = json_object(text)
        if isinstance(raw, str):
            self._reject(out, "invalid_json", raw)
            return out
        name = raw.get("event")
        model = schema.MESSAGES.get(name) if isinstance(name, str) else None
        if model is None:
            self._reject(out, "unknown_event", f"unknown event {name!r}")
            return out
        try:
            message = model.model_validate(raw)
        except ValidationError as exc:
            self._reject(out, "malformed", f"{name}: {schema.first_problem(exc)}")
            return out
        _HANDLERS[name](self, message, out)
        return out

    def receive_sideband(self, data: str | bytes) -> list[Effect]:
        """A frame from one of the call's sidebands: a Realtime client event for this call."""
        out: list[Effect] = []
        if self.closed:
            return out
        if isinstance(data, bytes):
            self.view.error(out, "invalid_frame",
                            "Binary frames are not supported; send JSON text frames.")
        else:
            self.view.receive(out, data, self._sideband_handlers)
        return out

    # -- Twilio messages ------------------------------------------------------------------

    def _on_connected(self, msg: schema.Connected, out: list[Effect]) -> None:
        out.append(Notice(f"connected: protocol {msg.protocol} {msg.version}"))

    def _on_start(self, msg: schema.Start, out: list[Effect]) -> None:
        if self.stream is not None:
            self._reject(out, "duplicate_start", f"stream {self.stream.streamSid} already started")
            return
        fmt = msg.start.mediaFormat
        if (fmt.encoding, fmt.sampleRate, fmt.channels) != ("audio/x-mulaw", RATE, 1):
            self._reject(out, "unsupported_format",
                         f"media format {fmt.encoding}/{fmt.sampleRate}/{fmt.channels}; "
                         "only audio/x-mulaw 8000 Hz mono is carried")
            return
        if msg.streamSid != msg.start.streamSid:
            self._reject(out, "wrong_stream",
                         f"start names stream {msg.start.streamSid} but is sent on {msg.streamSid}")
            return
        self.stream = msg.start
        self.last_seq = int(msg.sequenceNumber)
        out.append(Notice(f"call {msg.start.callSid} started: stream {msg.streamSid}, "
                          f"tracks {msg.start.tracks}, parameters {msg.start.customParameters}"))
        out.append(StreamStarted(msg.start.callSid, msg.streamSid))
        if self.options.duplex:
            self.duplex = True
            # The model hears the whole call, on its own frame clock.
            self.clock.gate.enabled = False
            out.append(EngineSetDuplex(True))
            self._start_reply(out, commit=False)

    def _gate(self, msg: schema.Media | schema.Dtmf | schema.Mark | schema.Stop) -> str | None:
        """The reason a message of the started stream cannot be taken, or None (and it counts)."""
        if self.stream is None:
            return "before_start"
        if msg.streamSid != self.stream.streamSid:
            return "wrong_stream"
        if int(msg.sequenceNumber) <= self.last_seq:
            return "out_of_order"
        self.last_seq = int(msg.sequenceNumber)
        return None

    def _gate_message(self, reason: str, msg) -> str:
        if reason == "before_start":
            return f"{msg.event} before the stream started"
        if reason == "wrong_stream":
            return f"{msg.event} for stream {msg.streamSid}, not {self.stream.streamSid}"
        return f"{msg.event} sequenceNumber {msg.sequenceNumber} after {self.last_seq}"

    def _on_media(self, msg: schema.Media, out: list[Effect]) -> None:
        try:
            data = base64.b64decode(msg.media.payload, validate=True)
        except (binascii.Error, ValueError):
            self._reject(out, "bad_base64", f"media {msg.sequenceNumber}: payload is not base64")
            return
        n = len(data)
        self.core.handle(cmd.AudioReceived(INPUT_TRACK, n))
        reason = self._gate(msg)
        if reason is None and msg.media.track != "inbound":
            reason = "wrong_track"
        if reason is not None:
            self.core.handle(cmd.InputDropped(INPUT_TRACK, n, reason))
            detail = (f"media on track {msg.media.track!r}" if reason == "wrong_track"
                      else self._gate_message(reason, msg))
            self._reject(out, reason, f"{detail}; {n} samples dropped")
            return
        out += self.clock.input_effects(g711_to_float(data, "ulaw"), detect_speech=True)
        self.core.handle(cmd.InputConsumed(INPUT_TRACK, n))

    def _on_dtmf(self, msg: schema.Dtmf, out: list[Effect]) -> None:
        reason = self._gate(msg)
        if reason is not None:
            self._reject(out, reason, self._gate_message(reason, msg))
            return
        digit = msg.dtmf.digit
        self.digits.append(digit)
        out.append(DtmfReceived(digit))
        if digit == self.options.end_call_digit:
            out.append(Notice(f"end-call digit {digit} pressed"))
            self._close(out, 1000, "end_call_digit")

    def _on_mark(self, msg: schema.Mark, out: list[Effect]) -> None:
        reason = self._gate(msg)
        if reason is not None:
            self._reject(out, reason, self._gate_message(reason, msg))
            return
        sent = self.marks.pop(msg.mark.name, None)
        if sent is None:
            self._reject(out, "unknown_mark", f"mark {msg.mark.name!r} was never sent or already echoed")
            return
        # A mark sent before the latest clear may come back because the clear dropped it:
        # unheard, as far as anyone can tell.
        if (sent.epoch == self.core.epoch and sent.clears == self.clears
                and sent.end > self.core.played_samples):
            self.core.handle(cmd.PlaybackAcknowledged(sent.end))
            self.pacer.heard(self.core.played_samples)
            self._echo_untimed = True

    def _on_stop(self, msg: schema.Stop, out: list[Effect]) -> None:
        if self.stream is not None:
            reason = self._gate(msg)
            if reason is not None:
                self._reject(out, reason, self._gate_message(reason, msg))
                return
        out.append(Notice(f"call {msg.stop.callSid} stopped"))
        self._close(out, 1000, "stop")

    def _reject(self, out: list[Effect], reason: str, message: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        out.append(Rejected(reason, message))

    def _close(self, out: list[Effect], code: int, reason: str) -> None:
        self.closed = True
        out.append(CloseConnection(code, reason))

    # -- turn detection -------------------------------------------------------------------

    def on_vad(self, probs: list[float], early: float | None = None) -> list[Effect]:
        out: list[Effect] = []
        if self.closed or self.stream is None:
            return out
        for command in self.clock.speech_decisions(probs, early):
            if self.duplex:
                # The model hears the caller in the same frames and decides for itself.
                if isinstance(command, (cmd.SpeechStarted, cmd.SpeechStopped)):
                    out.append(Notice(f"caller speech {type(command).__name__} at sample "
                                      f"{command.at_sample}"))
            elif isinstance(command, cmd.SpeechStarted):
                out.append(Notice(f"speech started at sample {command.at_sample}"))
                self.view.speech(out, "speech_started", command.at_sample, RATE)
                # Speech over a playing reply pauses it (or, with no minimum, is a barge-in:
                # epoch bump, flush, transcript cut at the last echoed mark).
                self._judge(out, self.core.handle(command))
            elif isinstance(command, cmd.SpeechStopped):
                self._speech_stopped(out, command)
            elif isinstance(command, ScoreTurn):
                out.append(self.clock.score_request(command))
            else:
                self._judge(out, self.core.handle(command))
        out += self.clock.released_input()
        return out

    def on_turn_score(self, request: int, complete: float | None) -> list[Effect]:
        """The end-of-turn model's answer for a pause: a complete turn ends now."""
        out: list[Effect] = []
        if not (self.closed or self.stream is None or self.duplex):
            stopped = self.clock.turn_scored(request, complete)
            if stopped is not None:
                self._speech_stopped(out, stopped)
        return out

    def _speech_stopped(self, out: list[Effect], stopped: cmd.SpeechStopped) -> None:
        events = self.core.handle(stopped)
        self._judge(out, events)
        if any(isinstance(e, ev.UserTurnEnded) for e in events):
            out.append(Notice(f"speech stopped at sample {stopped.at_sample} "
                              f"(turn ended by {stopped.ended_by})"))
            self.view.speech(out, "speech_stopped", stopped.at_sample, RATE)
            out.append(TurnEnded(stopped.ended_by))
            self._start_reply(out)

    def _judge(self, out: list[Effect], events: list[ev.Event]) -> None:
        barged: BargedIn | None = None
        for e in events:
            if isinstance(e, ev.OutputPaused):
                out.append(Notice(f"response {e.response_id} paused: speech at sample {e.onset}"))
                # The phone stops now; if the reply resumes, it goes on from what was heard.
                self._resend = self._clear(out)
            elif isinstance(e, ev.InterruptionConfirmed):
                out.append(InterruptionJudged(True))
                out.append(Notice(f"interruption confirmed: speech from sample {e.onset}"))
                if any(isinstance(x, ev.Flush) for x in events):
                    barged = BargedIn(e.onset)
            elif isinstance(e, ev.OutputResumed):
                out.append(InterruptionJudged(False))
                out.append(Notice(f"response {e.response_id} resumed: false interruption, "
                                  f"speech from sample {e.onset} to {e.speech_end}"))
                self.clock.forget_speech()
        self._apply_core_events(out, events)
        if barged is not None:
            # Timed from the speech's onset to the cut (the phone was cleared at the pause).
            out.append(barged)

    def _clear(self, out: list[Effect]) -> bool:
        """Empty Twilio's buffer if it may hold reply audio (a mark not yet echoed since the
        last clear); True if a clear went."""
        if not any(m.clears == self.clears for m in self.marks.values()):
            return False
        self.clears += 1
        out.append(Send({"event": "clear", "streamSid": self.stream.streamSid}))
        return True

    def _start_reply(self, out: list[Effect], commit: bool = True) -> None:
        events = self.core.handle(cmd.StartResponse())
        started = next(e for e in events if isinstance(e, ev.ResponseStarted))
        self.reply = Reply(started.epoch)
        out.append(Notice(f"response {started.response_id} started in epoch {started.epoch}"))
        self.view.started(out, started)
        if commit:
            out += self.clock.commit_input()
            out.append(EngineCommit(started.epoch, self.view.spec()))

    def _apply_core_events(self, out: list[Effect], events: list[ev.Event]) -> None:
        for e in events:
            out += self.clock.cancel_effects(e)
            if isinstance(e, ev.Flush):
                self._pending = self._pending[:0]
                self._pending_text = ""
                self._clear(out)
            elif isinstance(e, ev.ResponseCancelled):
                out.append(Notice(f"response {e.response_id} cancelled ({e.reason}): "
                                  f"heard {e.heard_samples} samples"))
                self.reply = None
                self.view.ended(out, e.response_id, self._transcript(e.response_id), e.reason)
            elif isinstance(e, ev.TranscriptTruncated):
                out.append(Notice(f"response {e.response_id} transcript truncated at sample "
                                  f"{e.audio_end_sample}: {e.heard_text!r}"))
        self.clock.settle()

    # -- engine results and pacing ----------------------------------------------------------

    def on_engine_audio(self, epoch: int, pcm: np.ndarray, text: str) -> list[Effect]:
        r = self.reply
        if r is not None and epoch == r.epoch and not self.closed:
            self._queue(self.clock.reply_audio(pcm), text, last=False)
        return []

    def on_engine_finished(self, epoch: int, reason: str = "completed") -> list[Effect]:
        r = self.reply
        if r is not None and epoch == r.epoch and not self.closed:
            self._queue(self.clock.reply_tail(), "", last=True)
            r.engine_done = True
        return []

    def on_engine_tool_call(self, epoch: int, piece) -> list[Effect]:
        """A function call the model is writing (the caller hears none of it): for the
        sidebands, which answer it."""
        out: list[Effect] = []
        r = self.reply
        if r is not None and epoch == r.epoch and not self.closed:
            self.view.tool_call(out, self.core.responses[-1].id, piece)
        return out

    def on_engine_duplex(self, epoch: int, pcm: np.ndarray, text: str, voiced: bool,
                         at: int = 0) -> list[Effect]:
        """A duplex output frame, silence included: straight on to the caller."""
        r = self.reply
        if self.duplex and r is not None and epoch == r.epoch and not self.closed:
            self._queue(self.clock.reply_audio(pcm), text, last=False)
        return []

    def on_duplex_dropped(self, n_samples: int, reason: str) -> list[Effect]:
        self.duplex_dropped[reason] = self.duplex_dropped.get(reason, 0) + n_samples
        return [Notice(f"the engine fell behind: {n_samples} input samples skipped ({reason})")]

    def duplex_refused(self, message: str) -> list[Effect]:
        """No room for one more duplex session: the call goes on turn by turn."""
        out: list[Effect] = [Notice(f"duplex refused, taking turns: {message}")]
        self.duplex = False
        self.clock.gate.enabled = True
        self._apply_core_events(out, self.core.handle(cmd.Cancel("duplex_refused")))
        return out

    def on_engine_failed(self, message: str) -> list[Effect]:
        out: list[Effect] = [Notice(f"the model failed on this call: {message}")]
        self.pacer.flush()
        self._close(out, 1011, "model error")
        return out

    def _queue(self, audio: np.ndarray, text: str, *, last: bool) -> None:
        """Cut reply audio into whole 20 ms frames; the reply's last frame is padded with silence."""
        data = np.concatenate([self._pending, audio])
        n = len(data) // FRAME * FRAME
        if last and n < len(data):
            n += FRAME
            data = np.pad(data, (0, n - len(data)))
        text = self._pending_text + text
        if n == 0 and not (last and text):
            self._pending, self._pending_text = data, text
            return
        self._pending, self._pending_text = data[n:], ""
        for e in self.core.handle(cmd.OutputChunkProduced(self.reply.epoch, n, text)):
            if isinstance(e, ev.OutputChunk):
                self.pacer.push(e, float_to_g711(data[:n], "ulaw"))

    def release_output(self, now: int) -> list[Effect]:
        """Send the reply audio due at clock sample `now` (at most output_lead ahead, in whole
        frames), each piece as 20 ms media messages followed by its mark."""
        out: list[Effect] = []
        if self.closed:
            return out
        if self._echo_untimed:
            self._echo_untimed, self._echoed_at = False, now
        if self._resend:
            self._resend = False
            self.pacer.resend_from(self._playing_at(now))
        for chunk, payload in self.clock.due(now):
            self._send_chunk(out, chunk, payload)
        r = self.reply
        if r is not None and r.engine_done and not self.pacer:
            for e in self.core.handle(cmd.ResponseCompleted(r.epoch)):
                if isinstance(e, ev.ResponseDone):
                    out.append(Notice(f"response {e.response_id} generated: {e.n_samples} samples"))
                    self.view.ended(out, e.response_id, self._transcript(e.response_id))
            self.reply = None
        return out

    def _playing_at(self, now: int) -> int:
        """The output sample the caller's phone is playing at `now`, as the marks tell it:
        the watermark, advanced by the time since its echo came, but no further than
        continuous playback of what was sent could reach."""
        heard = self.core.played_samples
        if self._echoed_at is None:
            return heard
        return max(heard, min(heard + now - self._echoed_at, self.pacer.played(now)))

    def _send_chunk(self, out: list[Effect], chunk: ev.OutputChunk, payload: bytes) -> None:
        self.clock.guard.played(chunk.start_sample, g711_to_float(payload, "ulaw"))
        sid = self.stream.streamSid
        # Frames on the output clock's 20 ms grid; a resend from mid-frame starts with a short one.
        cuts = [0, *range(-chunk.start_sample % FRAME or FRAME, len(payload), FRAME), len(payload)]
        for a, b in pairwise(cuts):
            out.append(Send({"event": "media", "streamSid": sid,
                             "media": {"payload": base64.b64encode(payload[a:b]).decode()}}))
        name = mark_name(chunk, self.marks_sent)
        self.marks_sent += 1
        self.marks[name] = SentMark(chunk.epoch, chunk.start_sample + chunk.n_samples, self.clears)
        out.append(Send({"event": "mark", "streamSid": sid, "mark": {"name": name}}))

    # -- a sideband's requests ----------------------------------------------------------------

    def _sideband_response(self, event, out: list[Effect]) -> None:
        if event.response:
            raise ProtocolError("unsupported_on_twilio",
                          "response.create on a Twilio call takes no parameters: the session's "
                          "instructions and tools apply.", "response")
        if self.duplex:
            raise ProtocolError("invalid_request_error",
                          "In duplex mode the model decides when to speak; "
                          "response.create is not available.")
        if self.reply is not None:
            raise ProtocolError("conversation_already_has_active_response",
                          "Conversation already has an active response in progress. Wait "
                          "until the response is finished before creating a new one.")
        self._start_reply(out)

    def _sideband_cancel(self, event, out: list[Effect]) -> None:
        if self.reply is None or self.duplex:
            raise ProtocolError("response_cancel_not_active",
                          "Cancellation failed: no active response found.")
        self._apply_core_events(out, self.core.handle(cmd.Cancel("client_cancelled")))

    def _transcript(self, response_id: int) -> str:
        return next(r.transcript for r in self.core.responses if r.id == response_id)

    # -- the end ----------------------------------------------------------------------------

    def responses(self) -> list[dict[str, Any]]:
        """Each reply with what the caller heard of it: up to its last echoed mark."""
        core = self.core
        out = []
        for r in core.responses:
            if r.heard_samples is not None:
                status, heard = "cancelled", r.heard_samples
            else:
                status = "in_progress" if r.generating else "completed"
                heard = max(0, min(core.played_samples - r.start_sample, r.sent_samples))
            out.append({"id": r.id, "epoch": r.epoch, "status": status,
                        "sent_samples": r.sent_samples, "heard_samples": heard,
                        "transcript": r.text_before(heard)})
        return out

    def close(self) -> dict[str, Any]:
        """Release everything; returns the call's books: input accounting, replies and what
        was heard of them, rejections, DTMF."""
        self.closed = True
        self.pacer.flush()
        summary: dict[str, Any] = {
            "call_sid": self.stream.callSid if self.stream else None,
            "stream_sid": self.stream.streamSid if self.stream else None,
            "sample_rate": RATE,
            "responses": self.responses(),
            "played_samples": self.core.played_samples,
            "rejected": dict(self.rejected),
            "dtmf": "".join(self.digits),
            "duplex_dropped": dict(self.duplex_dropped),
        }
        released = self.core.handle(cmd.Close())
        summary["input"] = self.core.track(INPUT_TRACK).snapshot()
        summary["released"] = dict(next(e for e in released if isinstance(e, ev.Released)).items)
        return summary


_HANDLERS: dict[str, Callable[[TwilioProtocol, Any, list[Effect]], None]] = {
    "connected": TwilioProtocol._on_connected,
    "start": TwilioProtocol._on_start,
    "media": TwilioProtocol._on_media,
    "dtmf": TwilioProtocol._on_dtmf,
    "mark": TwilioProtocol._on_mark,
    "stop": TwilioProtocol._on_stop,
}
