"""Turn detection on a Realtime session: the speech detector's decisions become the user's
turns.

Speech over a reply pauses it until the core judges the interruption: a confirmed one says
speech_started (held until then) before the reply's cancellation; a false one lets the reply
go on. Speech that stops commits the user's audio and, with create_response, starts a reply:
after silence_duration_ms (server_vad), or (semantic_vad) at a short pause the end-of-turn
model judges complete, or after eagerness's longest wait;
`idle_timeout_ms` speaks up after a stretch with neither speech nor a reply. In duplex, user
speech is information: it neither interrupts nor ends a turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from duplex.media.rates import REALTIME_RATE as RATE
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.session.turn_detection import (
    EAGERNESS_WAIT_MS,
    SEMANTIC_ASK_MS,
    SEMANTIC_PAUSE_MS,
    ScoreTurn,
    TurnDetector,
)
from duplex.transport.core import MediaClock
from duplex.transport.effects import InterruptionJudged, TurnEnded
from duplex.transport.realtime import schema
from duplex.transport.realtime.events import EventWriter
from duplex.transport.realtime.input_audio import InputAudio
from duplex.transport.realtime.replies import Replies
from duplex.transport.realtime.session_config import SessionSettings, response_settings

_EAGERNESS_SILENCE_MS = {"low": 1500, "medium": 800, "auto": 800, "high": 300}
"""semantic_vad's eagerness on a server without the end-of-turn model: the silence that ends
a turn."""


def silence_ms(td: schema.TurnDetection, semantic: bool = False) -> int:
    if td.type == "semantic_vad":
        return (EAGERNESS_WAIT_MS if semantic else _EAGERNESS_SILENCE_MS)[td.eagerness or "auto"]
    return td.silence_duration_ms


def detector_for(td: schema.TurnDetection | None, position: int,
                 semantic: bool = False) -> TurnDetector:
    """A detector for `td` (server_vad's defaults without one), its clock at `position`;
    `semantic`: the server has the end-of-turn model, which semantic_vad asks."""
    td = td or schema.TurnDetection(type="server_vad")
    asks = semantic and td.type == "semantic_vad"
    return TurnDetector(
        threshold=td.threshold,
        silence_samples=silence_ms(td, asks) * RATE // 1000,
        prefix_samples=td.prefix_padding_ms * RATE // 1000,
        pause_samples=SEMANTIC_PAUSE_MS * RATE // 1000 if asks else None,
        ask_samples=SEMANTIC_ASK_MS * RATE // 1000 if asks else None,
        position=position,
    )


class Turns:
    def __init__(self, clock: MediaClock, events: EventWriter, replies: Replies,
                 input_audio: InputAudio, settings: Callable[[], SessionSettings],
                 beta: bool) -> None:
        self.clock = clock
        self.core = clock.core
        self.events = events
        self.replies = replies
        self.input = input_audio
        self.settings = settings
        self.beta = beta
        self._held_onset: int | None = None
        """Onset of speech that paused the reply, whose speech_started waits for its judgement."""
        self._idle_since: int | None = None
        """Clock sample since which nothing has happened, for turn_detection.idle_timeout_ms."""

    def on_vad(self, out: list, probs: list[float], early: float | None = None, *,
               duplex: bool) -> None:
        for command in self.clock.speech_decisions(probs, early):
            if duplex:
                if isinstance(command, (cmd.SpeechStarted, cmd.SpeechStopped)):
                    self._duplex_speech(out, command)
            elif isinstance(command, cmd.SpeechStarted):
                self._speech_started(out, command.at_sample)
            elif isinstance(command, cmd.SpeechStopped):
                self._speech_stopped(out, command)
            elif isinstance(command, ScoreTurn):
                out.append(self.clock.score_request(command))
            else:
                self._judge(out, self.core.handle(command))
        self.input.to_model(out, self.clock.released_input())

    def on_turn_score(self, out: list, request: int, complete: float | None) -> None:
        """The end-of-turn model's answer for a pause: a complete turn ends now."""
        stopped = self.clock.turn_scored(request, complete)
        if stopped is not None:
            self._speech_stopped(out, stopped)

    def _answers(self) -> bool:
        """Whether a turn that ends starts a reply (never in a transcription session)."""
        s = self.settings()
        return s.turn_detection.create_response and s.type != "transcription"

    def _reply(self, out: list) -> None:
        self.replies.start(out, response_settings(self.settings(), None, self.beta))

    def _speech_started(self, out: list, at: int) -> None:
        self.input.speech_item_id = self.events.new_id("item")
        td = self.settings().turn_detection
        if self.replies.active is not None and not td.interrupt_response:
            self._announce_speech(out, at)
            return
        # The core pauses a playing reply (or, with no minimum, cuts it: epoch bump, flush,
        # transcript cut at the playback watermark).
        events = self.core.handle(cmd.SpeechStarted(at))
        paused = next((e for e in events if isinstance(e, ev.OutputPaused)), None)
        if paused is None:
            self._announce_speech(out, at)
        else:
            # A client that hears speech_started stops its own playback: it is told only once
            # the speech has lasted, so a cough leaves the reply playing there too.
            self._held_onset = at
            self._duplex_event(out, "duplex.output.paused", audio_start_ms=at * 1000 // RATE)
        self._judge(out, events)

    def _announce_speech(self, out: list, at: int) -> None:
        self._held_onset = None
        start = max(0, at - self.clock.detector.prefix_samples)
        self.events.emit(out, "input_audio_buffer.speech_started",
                         audio_start_ms=start * 1000 // RATE, item_id=self.input.speech_item_id)

    def _judge(self, out: list, events: list[ev.Event]) -> None:
        """Core events of speech over a reply: a confirmed interruption says speech_started
        (if it was held) before the reply's cancellation; a false one lets the reply go on."""
        for e in events:
            if isinstance(e, ev.InterruptionConfirmed):
                out.append(InterruptionJudged(True))
                if self._held_onset is not None:
                    self._announce_speech(out, e.onset)
            elif isinstance(e, ev.OutputResumed):
                out.append(InterruptionJudged(False))
                self._held_onset = None
                self.input.speech_item_id = None
                self.clock.forget_speech()
                self._duplex_event(out, "duplex.output.resumed",
                                   audio_start_ms=e.onset * 1000 // RATE,
                                   audio_end_ms=e.speech_end * 1000 // RATE)
        self.replies.apply_core_events(out, events)

    def _duplex_event(self, out: list, type_: str, **fields: Any) -> None:
        if self.settings().duplex_events:
            active = self.replies.active
            self.events.emit(out, type_, response_id=active.id if active is not None else None,
                             **fields)

    def _duplex_speech(self, out: list, decision: cmd.SpeechStarted | cmd.SpeechStopped) -> None:
        """In duplex the model hears the speech in the same frames and decides itself."""
        if isinstance(decision, cmd.SpeechStarted):
            self.input.speech_item_id = self.events.new_id("item")
            start = max(0, decision.at_sample - self.clock.detector.prefix_samples)
            self.events.emit(out, "input_audio_buffer.speech_started",
                             audio_start_ms=start * 1000 // RATE,
                             item_id=self.input.speech_item_id)
        else:
            self.events.emit(out, "input_audio_buffer.speech_stopped",
                             audio_end_ms=decision.at_sample * 1000 // RATE,
                             item_id=self.input.speech_item_id or self.events.new_id("item"))
            self.input.speech_item_id = None

    def _speech_stopped(self, out: list, stopped: cmd.SpeechStopped) -> None:
        at = stopped.at_sample
        events = self.core.handle(stopped)
        self._judge(out, events)
        if any(isinstance(e, ev.OutputResumed) for e in events):
            return
        item_id = self.input.speech_item_id or self.events.new_id("item")
        self.events.emit(out, "input_audio_buffer.speech_stopped",
                         audio_end_ms=at * 1000 // RATE, item_id=item_id)
        self.input.commit_as(out, item_id)
        out.append(TurnEnded(stopped.ended_by))
        if self._answers() and self.replies.active is None:
            self._reply(out)
        self._idle_since = None

    def check_idle(self, out: list, now: int) -> None:
        """turn_detection.idle_timeout_ms: after that long with neither speech nor a reply, the
        server says so, commits what it has and (with create_response) replies, once."""
        td = self.settings().turn_detection
        busy = (self.replies.active is not None or self.clock.detector.speaking
                or self.core.unplayed_samples)
        if td is None or td.idle_timeout_ms is None or busy:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
            return
        if now - self._idle_since < td.idle_timeout_ms * RATE // 1000:
            return
        item_id = self.events.new_id("item")
        self.events.emit(out, "input_audio_buffer.timeout_triggered",
                         audio_start_ms=self._idle_since * 1000 // RATE,
                         audio_end_ms=now * 1000 // RATE, item_id=item_id)
        self.input.commit_as(out, item_id)
        if self._answers():
            self._reply(out)
        self._idle_since = None
