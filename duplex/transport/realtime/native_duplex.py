"""A Realtime session's side of native full duplex (`turn_detection: {"type": "duplex"}`):
whether the model can run it, telling the engine when the session starts or stops, the
model's frames turned into replies through `DuplexSegments`, and a cancel that also fences the
segment under way. Only models that run duplex (see `NATIVE_MODELS`) accept the setting.
"""

from __future__ import annotations

from typing import Any

from duplex.transport.core import MediaClock
from duplex.transport.effects import EngineSetDuplex
from duplex.transport.realtime import schema
from duplex.transport.realtime.duplex_mode import (
    BETA_PARAM,
    MODEL_PARAM,
    DuplexSegments,
    SegmentAudio,
    SegmentEnd,
    SegmentStart,
    not_native,
)
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.realtime.events import EventWriter
from duplex.transport.realtime.replies import Replies
from duplex.transport.realtime.session_config import SessionSettings, response_settings


class NativeDuplex:
    def __init__(self, clock: MediaClock, events: EventWriter, replies: Replies, *,
                 native: bool, models: tuple[str, ...], model: str, beta: bool) -> None:
        self.clock = clock
        self.events = events
        self.replies = replies
        self.native = native
        """Whether the model runs native full duplex."""
        self.models = models
        """The models that can, named in the error a turn-based model answers with."""
        self.model = model
        self.beta = beta
        self.segments: DuplexSegments | None = None
        """The model's spoken segments while the session runs duplex; None for turns."""
        self.dropped: dict[str, int] = {}
        """Input samples the engine skipped in duplex, by reason (it fell behind)."""

    def check(self, new: SessionSettings) -> None:
        td = new.turn_detection
        if td is not None and td.type == "duplex" and not self.native:
            param = BETA_PARAM if self.beta else MODEL_PARAM
            raise ProtocolError("invalid_value", not_native(self.model, param, self.models), param)

    def sync(self, out: list, td: schema.TurnDetection | None) -> None:
        """Tell the engine when the session starts or stops running native duplex."""
        want = td is not None and td.type == "duplex"
        if want == (self.segments is not None):
            if want:
                self.segments.silence_samples = self._silence_samples(td)
            return
        if self.replies.active is not None:
            # A reply of the other mode would never end in this one.
            self.cancel(out, "turn_detection_changed")
        self.segments = DuplexSegments(self._silence_samples(td)) if want else None
        out.append(EngineSetDuplex(want))

    def _silence_samples(self, td: schema.TurnDetection) -> int:
        """The model's silence (at its output rate) that ends its spoken segment."""
        return max(1, td.silence_duration_ms * self.clock.model_output_rate // 1000)

    def cancel(self, out: list, reason: str) -> None:
        """Cancel the reply; in duplex the model's segment under way is fenced too."""
        self.replies.cancel(out, reason)
        if self.segments is not None:
            self.segments.cancel(self.clock.core.epoch)

    def frame(self, out: list, settings: SessionSettings, epoch: int, pcm: Any, text: str,
              voiced: bool, at: int) -> None:
        for action in self.segments.frame(epoch, pcm, text, voiced, at):
            if isinstance(action, SegmentStart):
                if self.replies.active is None:
                    self.replies.start(out, response_settings(settings, None, self.beta),
                                       commit=False)
                    self._placed(out, settings, action.at)
            elif isinstance(action, SegmentAudio):
                self.replies.on_audio(action.epoch, action.pcm, action.text)
            elif isinstance(action, SegmentEnd):
                self.replies.on_finished(action.epoch, "completed")

    def _placed(self, out: list, settings: SessionSettings, at: int) -> None:
        """Where the reply starts on the input timeline, for clients that asked for duplex's
        own events: output frame k lies at input frame k + the model's delay."""
        active = self.replies.active
        if settings.duplex_events and active is not None:
            self.events.emit(out, "duplex.response.placed", response_id=active.id,
                             audio_start_ms=at * 1000 // self.clock.model_output_rate)

    def on_dropped(self, n_samples: int, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n_samples
