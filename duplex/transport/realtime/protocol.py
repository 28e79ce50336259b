"""The OpenAI Realtime protocol as a pure state machine around the session core.

Text frames in (`receive_text`), engine results and VAD probabilities in, and out come plain
effects: server events to send, work for the engine, audio for the VAD, a close. The asyncio
edge (ws.py) carries them out; nothing here awaits, sleeps or touches a socket. Time enters
only as the sample count the edge passes to `release_output`, which paces reply audio.

All counts are samples on a 24 kHz session clock in both directions (the wire's own rate for
PCM; G.711's 8 kHz is resampled onto it), so audio_start_ms and audio_end_ms are exact.

This module parses and dispatches client events (by the `_HANDLERS` table), applies session
settings and answers errors; each concept has a part of its own that the protocol composes:
the input side (input_audio.py), turn detection (turns.py), conversation items (items.py),
replies (replies.py), MCP tools the server runs (mcp.py), native duplex (native_duplex.py) and
what a resume reads (resume.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pydantic import ValidationError

from duplex.engine.thinker_text import Piece
from duplex.media.fir import InputResamplers
from duplex.media.rates import REALTIME_RATE as RATE
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.session.errors import SessionError
from duplex.session.turn_detection import TurnDetector
from duplex.transport.core import MediaClock, json_object
from duplex.transport.effects import (
    CloseConnection,
    EngineCancel,
    EngineClearInput,
    EngineCommit,
    EngineInstruct,
    EngineMark,
    EnginePush,
    EnginePushFrame,
    EnginePushImage,
    EnginePushText,
    EngineReplay,
    EngineRewind,
    EngineSetDuplex,
    FlushAudio,
    HoldAudio,
    InterruptionJudged,
    InvalidToolCall,
    PlayAudio,
    ResumeAudio,
    ScoreTurnEnd,
    Send,
    TurnEnded,
    VadFeed,
)
from duplex.transport.realtime import resume, schema
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.duplex_mode import NATIVE_MODELS, DuplexSegments
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.realtime.events import ActiveResponse, EventWriter
from duplex.transport.realtime.input_audio import InputAudio, Transcribe
from duplex.transport.realtime.items import Items
from duplex.transport.realtime.mcp import MAX_FOLLOW_UPS, CallTool, ListTools, McpTools
from duplex.transport.realtime.model_context import ModelContext
from duplex.transport.realtime.native_duplex import NativeDuplex
from duplex.transport.realtime.replies import Replies
from duplex.transport.realtime.resume import ResumeSession
from duplex.transport.realtime.session_config import (
    RESUME_GAP_MS,
    ConfigError,
    SessionSettings,
    Voices,
    beta_session,
    ga_session,
    min_interruption_ms,
    noise_reduction_type,
    response_settings,
    updated_beta,
    updated_ga,
)
from duplex.transport.realtime.turns import Turns, detector_for

Effect = (
    Send | EnginePush | EnginePushFrame | EnginePushText | EnginePushImage | EngineCommit
    | EngineCancel | EngineClearInput | VadFeed | PlayAudio | FlushAudio | HoldAudio
    | ResumeAudio | CloseConnection
    | ResumeSession | InvalidToolCall | EngineInstruct | Transcribe | EngineSetDuplex
    | InterruptionJudged | EngineMark | EngineRewind | EngineReplay | ListTools | CallTool
    | ScoreTurnEnd | TurnEnded
)


@dataclass
class Limits:
    max_message_bytes: int = 1 << 20
    max_input_lead_ms: int = 5000
    """How far appended audio may run ahead of real time before appends are refused."""
    output_lead_ms: int = 100
    max_errors: int = 100
    """Errors one connection may cause before it is closed (1008) as abusive."""
    mcp_timeout_s: float = 30.0
    """How long the server waits for an MCP server to list its tools or answer a call."""


class RealtimeProtocol:
    def __init__(
        self,
        session_id: str,
        *,
        model: str,
        model_input_rate: int,
        model_output_rate: int,
        beta: bool = False,
        limits: Limits | None = None,
        media_track: bool = False,
        video_interval_samples: int = RATE // 2,
        resume_token: str | None = None,
        duplex_events: bool = False,
        voices: Voices | None = None,
        transcription_models: tuple[str, ...] = (),
        transcription_languages: Callable[[str], tuple[str, ...] | None] = lambda model: None,
        native_duplex: bool = False,
        rewinds_context: bool = False,
        duplex_models: tuple[str, ...] = NATIVE_MODELS,
        start_duplex: bool = False,
        turn_model: bool = False,
    ) -> None:
        self.session_id = session_id
        self.turn_model = turn_model
        """The server has the end-of-turn model, which semantic_vad asks at a pause."""
        self.resume_token = resume_token
        """Sent once, in session.created (and session.resumed); the registry keeps its hash."""
        self.model = model
        self.beta = beta
        self.limits = limits or Limits()
        self.settings = SessionSettings(duplex_events=duplex_events)
        if start_duplex and native_duplex:
            # The model's configured default mode (duplex.default_mode): a client may ask for
            # turns with session.update.
            self.settings = replace(self.settings,
                                    turn_detection=schema.TurnDetection(type="duplex"))
        self.voices = voices or Voices()
        self._told_instructions: tuple[str, tuple] = ("", ())
        """The instructions and tools the engine was last told (EngineInstruct)."""
        self.clock = MediaClock(
            session_id, rate=RATE, model_input_rate=model_input_rate,
            model_output_rate=model_output_rate,
            lead_samples=self.limits.output_lead_ms * RATE // 1000,
            detector=detector_for(self.turn_detection, 0, turn_model),
            video_interval_samples=video_interval_samples,
        )
        self.core = self.clock.core
        self.pacer = self.clock.pacer
        self._apply_interruption()
        self._gate_input()
        self.events = EventWriter(beta)
        self.conversation = Conversation()
        self.context = ModelContext(self.conversation, rewinds_context,
                                    lambda: self._told_instructions)
        self.mcp = McpTools(self.events, self.conversation, self.context, self._follow_up)
        self.replies = Replies(self.clock, self.events, self.conversation, self.voices, self.mcp,
                               self.context, media_track=media_track,
                               conversation_id=_conversation_id(session_id))
        self.input = InputAudio(self.clock, self.events, self.conversation, lambda: self.settings,
                                self.context, max_lead_ms=self.limits.max_input_lead_ms,
                                transcription_models=transcription_models,
                                transcription_languages=transcription_languages)
        self.turns = Turns(self.clock, self.events, self.replies, self.input,
                           lambda: self.settings, beta)
        self.duplex = NativeDuplex(self.clock, self.events, self.replies, native=native_duplex,
                                   models=duplex_models, model=model, beta=beta)
        self.items = Items(self.clock, self.events, self.conversation, self.input, self.replies,
                           self.context, self.duplex.cancel, model_input_rate, self.mcp)
        self.errors = 0
        self.client_events = 0
        self.closed = False
        self.more_waiting: Callable[[], bool] = lambda: False
        """Whether more input waits to be handled (the edge says)."""

    # -- event framing and the session's state -----------------------------------------------

    def _emit(self, out: list[Effect], type_: str, **fields: Any) -> None:
        self.events.emit(out, type_, **fields)

    def _error(self, out: list[Effect], code: str, message: str, param: str | None = None,
               client_event_id: str | None = None, kind: str = "invalid_request_error") -> None:
        self.errors += 1
        self.events.error(out, kind, code, message, param, client_event_id)
        if self.errors > self.limits.max_errors and not self.closed:
            self.closed = True
            out.append(CloseConnection(1008, f"more than {self.limits.max_errors} errors"))

    def session_object(self) -> dict[str, Any]:
        """The whole effective session, in the client's spelling."""
        render = beta_session if self.beta else ga_session
        return render(self.settings, self.session_id, self.model)

    @property
    def turn_detection(self) -> schema.TurnDetection | None:
        return self.settings.turn_detection

    @property
    def detector(self) -> TurnDetector:
        return self.clock.detector

    @property
    def response(self) -> ActiveResponse | None:
        return self.replies.active

    @property
    def segments(self) -> DuplexSegments | None:
        return self.duplex.segments

    # -- entry points ---------------------------------------------------------------------

    def _session_with_token(self) -> dict[str, Any]:
        session = self.session_object()
        if self.resume_token is not None:
            session["resume_token"] = self.resume_token
        return session

    def start(self) -> list[Effect]:
        out: list[Effect] = []
        self._emit(out, "session.created", session=self._session_with_token())
        self._instruct(out)
        self.mcp.sync(out, self.settings)
        self.duplex.sync(out, self.turn_detection)
        return out

    def attached(self) -> dict[str, Any]:
        """session.created for a sideband attaching now: the session as it stands, without the
        resume token (the carrier's alone)."""
        out: list[Effect] = []
        self._emit(out, "session.created", session=self.session_object())
        return out[0].event

    def _instruct(self, out: list[Effect]) -> None:
        """Tell the engine the session's instructions and tools when they change, so the
        model can place its system turn before any input (see `DuplexModel.instruct`)."""
        told = (self.settings.instructions, self.mcp.offered(self.settings.tools))
        if told != self._told_instructions:
            self._told_instructions = told
            out.append(EngineInstruct(*told))

    def receive_bytes(self, data: bytes) -> list[Effect]:
        out: list[Effect] = []
        self._error(out, "invalid_frame", "Binary frames are not supported; send JSON text frames.")
        return out

    def receive_text(self, text: str) -> list[Effect]:
        out: list[Effect] = []
        if self.closed:
            return out
        if len(text.encode()) > self.limits.max_message_bytes:
            self._error(out, "message_too_large",
                        f"Message of {len(text.encode())} bytes exceeds the limit of "
                        f"{self.limits.max_message_bytes} bytes.")
            self.closed = True
            out.append(CloseConnection(1009, "message too large"))
            return out
        raw = json_object(text)
        if isinstance(raw, str):
            self._error(out, "invalid_json", f"The message is {raw}.")
            return out
        event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
        type_ = raw.get("type")
        if not isinstance(type_, str):
            self._error(out, "missing_required_parameter", "Missing required parameter: 'type'.",
                        "type", event_id)
            return out
        model = schema.CLIENT_EVENTS.get(type_)
        if model is None:
            self._error(out, "invalid_event_type", f"Unknown event type '{type_}'.", "type", event_id)
            return out
        try:
            event = model.model_validate(raw)
        except ValidationError as exc:
            param, message = schema.first_problem(exc)
            self._error(out, "invalid_value", message, param, event_id)
            return out
        self.client_events += 1
        try:
            _HANDLERS[type_](self, event, out)
        except ProtocolError as exc:
            self._error(out, exc.code, str(exc), exc.param, event_id)
        except SessionError as exc:
            self._error(out, exc.code, str(exc), None, event_id)
        return out

    def receive_audio(self, pcm: np.ndarray) -> list[Effect]:
        """Audio from a media track (WebRTC), float32 at 24 kHz: the same path as an append."""
        out: list[Effect] = []
        if not self.closed:
            try:
                self.input.receive(out, pcm)
            except ProtocolError as exc:
                self._error(out, exc.code, str(exc), exc.param)
        return out

    def receive_video_frame(self, frame: Any, pts_sample: int) -> list[Effect]:
        """A camera frame: the core samples frames by timestamp; sampled ones go to the model."""
        out: list[Effect] = []
        if self.closed:
            return out
        try:
            sampled = self.core.handle(cmd.VideoFrameReceived(pts_sample))
        except SessionError as exc:
            self._error(out, exc.code, str(exc))
            return out
        if sampled:
            self.core.handle(cmd.InputConsumed("video", 1))
            out.append(EnginePushFrame(frame))
        return out

    def refuse(self, code: str, message: str, param: str | None = None) -> list[Effect]:
        """An error the edge decided on (a refused resume, a rate limit); the session goes on."""
        out: list[Effect] = []
        self._error(out, code, message, param)
        return out

    def end(self, code: str, message: str, close_code: int, reason: str) -> list[Effect]:
        """Say why, then close: the session was taken over, or ran past its time."""
        out: list[Effect] = []
        self._error(out, code, message)
        if not self.closed:
            self.closed = True
            out.append(CloseConnection(close_code, reason))
        return out

    # -- resume ---------------------------------------------------------------------------

    def _on_session_resume(self, event: schema.SessionResume, out: list[Effect]) -> None:
        # Later, the fresh session has already taken input the resumed one never saw.
        if self.client_events != 1:
            raise ProtocolError("session_resume_not_first",
                                "session.resume must be the first event on a connection.", "type")
        out.append(ResumeSession(event.session_id, event.resume_token))

    def resumed(self, session_id: str, conversation: list[dict[str, Any]],
                config: dict[str, Any], context: dict[str, Any] | None = None,
                units: list[int] = ()) -> list[Effect]:
        """The edge claimed `session_id`: continue its conversation on this connection.
        Nothing is replayed: items come back as they were heard and no audio is resent.

        `context` says how much of the model's context the edge put back (the extension field
        `rebuilt_context`); the engine then holds the system turn that context opened with,
        and the session's instructions reach it with the next reply, as they did before.
        `units` are the parts of it that conversation items laid, in order."""
        self.session_id = session_id
        self.core.id = session_id
        self.replies.conversation_id = _conversation_id(session_id)
        self.conversation.replace_all([Item.from_record(i) for i in conversation])
        self.context.restore(list(units))
        self._set_settings(SessionSettings.from_record(config))
        out: list[Effect] = []
        fields: dict[str, Any] = {"session": self._session_with_token()}
        if context is not None:
            fields["rebuilt_context"] = context
        self._emit(out, "session.resumed", **fields)
        if context is not None and context["items"]:
            self._told_instructions = (self.settings.instructions,
                                       self.mcp.offered(self.settings.tools))
        else:
            self._instruct(out)
        self.mcp.sync(out, self.settings)
        self.duplex.sync(out, self.turn_detection)
        return out

    def continue_epoch(self, epoch: int) -> None:
        """This connection took over the engine session a dropped one left at `epoch` (a
        resume on the node that kept it): replies go on from that epoch."""
        self.core.epoch = epoch

    def snapshot(self, now: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation as heard at clock sample `now`, and the session's settings: what a
        resume (on any node) continues from."""
        return resume.snapshot(self.conversation, self.settings, self.core, self.pacer, now)

    def input_state(self) -> InputResamplers:
        """Where the input path's resamplers stand, for a resume to go on from."""
        return InputResamplers(self.clock.input_state(), self.input.g711_state())

    def resume_input(self, state: InputResamplers) -> None:
        self.clock.resume_input(state.model)
        if state.g711 is not None:
            self.input.resume_g711(state.g711)

    def heard(self, core_id: int, now: int) -> int | None:
        """Samples of reply `core_id` heard at clock sample `now`; None when all of it was."""
        return resume.heard(self.core, self.pacer, core_id, now)

    # -- session settings -----------------------------------------------------------------

    def configure(self, session: dict[str, Any]) -> None:
        """Apply GA session settings without an event (an ephemeral key's, before
        session.created); raises ProtocolError."""
        try:
            new = updated_ga(self.settings, session)
        except ConfigError as exc:
            raise ProtocolError.of(exc) from None
        self.duplex.check(new)
        self._set_settings(new)

    def _on_session_update(self, event: schema.SessionUpdate, out: list[Effect]) -> None:
        update = updated_beta if self.beta else updated_ga
        try:
            new = update(self.settings, event.session)
        except ConfigError as exc:
            raise ProtocolError.of(exc) from None
        self.input.check_transcription(new, self.beta)
        self.duplex.check(new)
        voice_param = "session.voice" if self.beta else "session.audio.output.voice"
        if new.voice != self.settings.voice:
            try:
                self.voices.check(new.voice, voice_param)
            except ConfigError as exc:
                raise ProtocolError.of(exc) from None
            if self.core.sent_samples or self.core.flushed_samples:
                raise ProtocolError("cannot_update_voice",
                                    "Cannot update a conversation's voice if assistant audio is "
                                    "present.", voice_param)
        if new.output_format != self.settings.output_format and self.response is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                "The output format cannot change while a response is playing.",
                                "session.audio.output.format")
        self._set_settings(new)
        self._emit(out, "session.updated", session=self.session_object())
        self.mcp.sync(out, new)
        self._instruct(out)
        self.duplex.sync(out, self.turn_detection)

    def _set_settings(self, new: SessionSettings) -> None:
        detection_changed = new.turn_detection != self.settings.turn_detection
        self.settings = new
        if detection_changed:
            self.clock.detector = detector_for(self.turn_detection, self.input.samples,
                                               self.turn_model)
        self._apply_interruption()
        self._gate_input()

    def _gate_input(self) -> None:
        """Where turns are detected, the model hears each turn from its speech onset (less the
        prefix padding); without detection (the client commits) or in native duplex, all of it."""
        td = self.turn_detection
        self.clock.gate.enabled = td is not None and td.type != "duplex"

    def _apply_interruption(self) -> None:
        """turn_detection.min_interruption_ms and audio.input.noise_reduction, into the core and
        the echo guard."""
        self.core.handle(cmd.SetInterruption(
            min_interruption_ms(self.turn_detection) * RATE // 1000, RESUME_GAP_MS * RATE // 1000))
        self.clock.guard.set_strength(noise_reduction_type(self.settings))

    def duplex_refused(self, message: str) -> list[Effect]:
        """The engine has no room for one more duplex session: the session goes on by turns."""
        out: list[Effect] = []
        self.duplex.segments = None
        self._set_settings(replace(self.settings,
                                   turn_detection=schema.TurnDetection(type="server_vad")))
        self._error(out, "session_limit_reached", message, kind="server_error")
        self._emit(out, "session.updated", session=self.session_object())
        return out

    # -- replies, asked for; their output side lives in Replies -------------------------------

    def _on_response_create(self, event: schema.ResponseCreate, out: list[Effect]) -> None:
        if self.segments is not None:
            raise ProtocolError("invalid_request_error",
                                "In duplex mode the model decides when to speak; "
                                "response.create is not available.")
        if self.settings.type == "transcription":
            raise ProtocolError("invalid_request_error",
                                "A transcription session transcribes the user's turns and never "
                                "replies; response.create is not available.", "type")
        if self.response is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                f"Conversation already has an active response in progress: "
                                f"{self.response.id}. Wait until the response is finished before "
                                "creating a new one.")
        try:
            settings = response_settings(self.settings, event.response, self.beta)
            if settings.voice != self.settings.voice:
                self.voices.check(settings.voice, "response.voice" if self.beta
                                  else "response.audio.output.voice")
            settings = self.mcp.resolve(settings, strict=True)
        except ConfigError as exc:
            raise ProtocolError.of(exc) from None
        self.replies.start(out, settings)

    def _on_response_cancel(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        if self.response is None:
            raise ProtocolError("response_cancel_not_active",
                                "Cancellation failed: no active response found.")
        self.duplex.cancel(out, "client_cancelled")

    def _on_output_audio_buffer_clear(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        self.duplex.cancel(out, "client_cancelled")
        self._emit(out, "output_audio_buffer.cleared", response_id=None)

    # -- what the speech detector, the engine and the recogniser report -----------------------

    def on_vad(self, probs: list[float], early: float | None = None) -> list[Effect]:
        out: list[Effect] = []
        if self.turn_detection is not None and not self.closed:
            self.turns.on_vad(out, probs, early, duplex=self.segments is not None)
        return out

    def on_turn_score(self, request: int, complete: float | None) -> list[Effect]:
        out: list[Effect] = []
        if self.turn_detection is not None and not self.closed and self.segments is None:
            self.turns.on_turn_score(out, request, complete)
        return out

    def on_engine_audio(self, epoch: int, pcm: np.ndarray, text: str) -> list[Effect]:
        if not self.closed:
            self.replies.on_audio(epoch, pcm, text)
        return []

    def on_engine_duplex(self, epoch: int, pcm: np.ndarray, text: str, voiced: bool,
                         at: int = 0) -> list[Effect]:
        """One output frame of a duplex model, its first sample at `at` on the session's
        timeline (model output rate): spoken segments become responses."""
        out: list[Effect] = []
        if not self.closed and self.segments is not None:
            self.duplex.frame(out, self.settings, epoch, pcm, text, voiced, at)
        return out

    def on_duplex_dropped(self, n_samples: int, reason: str) -> list[Effect]:
        self.duplex.on_dropped(n_samples, reason)
        return []

    def on_engine_finished(self, epoch: int, reason: str = "completed",
                           usage: dict[str, Any] | None = None) -> list[Effect]:
        self.replies.on_finished(epoch, reason, usage)
        return []

    def on_engine_text(self, epoch: int, text: str) -> list[Effect]:
        out: list[Effect] = []
        if not self.closed:
            self.replies.on_text(out, epoch, text)
        return out

    def on_engine_tool_call(self, epoch: int, piece: Piece) -> list[Effect]:
        out: list[Effect] = []
        if not self.closed:
            self.replies.on_tool_call(out, epoch, piece)
        return out

    def on_mcp_listed(self, item_id: str, tools: list[dict[str, Any]] | None,
                      error: dict[str, Any] | None) -> list[Effect]:
        """What an MCP server listed (or why it could not), for `ListTools`."""
        out: list[Effect] = []
        if not self.closed:
            self.mcp.on_listed(out, item_id, tools, error)
            self._instruct(out)
        return out

    def on_mcp_called(self, item_id: str, output: str | None,
                      error: dict[str, Any] | None) -> list[Effect]:
        """What an MCP tool answered (or why it did not), for `CallTool`."""
        out: list[Effect] = []
        if not self.closed:
            self.mcp.on_called(out, item_id, output, error, self.response)
        return out

    def _follow_up(self, out: list[Effect], depth: int) -> None:
        """The reply the server asks for after MCP calls, so the model speaks with their
        results (none while another reply runs, in native duplex, or past MAX_FOLLOW_UPS)."""
        if self.closed or self.response is not None or self.segments is not None \
                or depth > MAX_FOLLOW_UPS:
            return
        settings = response_settings(self.settings, None, self.beta)
        self.replies.start(out, replace(settings, tool_choice="auto", follow_up=depth))

    def on_engine_failed(self, message: str) -> list[Effect]:
        """The model failed on this session: say so, end any reply, close with 1011."""
        out: list[Effect] = []
        self.replies.fail(out)
        self._error(out, "model_error", f"The model failed on this session: {message}",
                    kind="server_error")
        self.closed = True
        out.append(CloseConnection(1011, "model error"))
        return out

    def on_engine_timings(self, timings: dict[str, float]) -> list[Effect]:
        """Per-stage latency of the current reply, for clients that asked for duplex's own
        events (`duplex_events`)."""
        out: list[Effect] = []
        if self.response is not None and self.settings.duplex_events:
            self._emit(out, "duplex.response.timings", response_id=self.response.id,
                       timings_ms=timings)
        return out

    def on_transcript(self, item_id: str, text: str | None, error: str | None,
                      audio_s: float, partial: bool = False) -> list[Effect]:
        """The recogniser's answer for a user audio item: its transcript, or why there is none;
        a partial one, for audio not yet committed."""
        out: list[Effect] = []
        if not self.closed:
            self.input.on_transcript(out, item_id, text, error, audio_s, partial)
        return out

    def on_playback(self, played_sample: int) -> None:
        """The media track has played the output clock up to `played_sample`."""
        self.pacer.playhead = played_sample

    def release_output(self, now: int) -> list[Effect]:
        """Send the reply audio that is due at clock sample `now` (at most output_lead ahead)."""
        out: list[Effect] = []
        if not self.closed:
            self.replies.release(out, now)
            self.turns.check_idle(out, now)
            # A burst of edits (a client replacing its history item by item) is laid once,
            # when the burst is over, not once per event.
            if not self.more_waiting():
                active = self.response.item.unit if self.response is not None else None
                self.context.sync(out, active)
        return out

    def close(self) -> dict[str, int]:
        """Release everything; returns what the core held, by name."""
        self.closed = True
        self.pacer.flush()
        released = self.core.handle(cmd.Close())
        held = dict(next(e for e in released if isinstance(e, ev.Released)).items)
        held.update({f"duplex_dropped:{reason}": n for reason, n in self.duplex.dropped.items()})
        return held


def _conversation_id(session_id: str) -> str:
    return "conv_" + session_id.removeprefix("sess_")


_HANDLERS = {
    "session.resume": RealtimeProtocol._on_session_resume,
    "session.update": RealtimeProtocol._on_session_update,
    "input_audio_buffer.append": lambda p, e, out: p.input.append_base64(out, e.audio, "audio"),
    "input_audio_buffer.commit": lambda p, e, out: p.input.commit(out),
    "input_audio_buffer.clear": lambda p, e, out: p.input.clear(out),
    "output_audio_buffer.clear": RealtimeProtocol._on_output_audio_buffer_clear,
    "conversation.item.create": lambda p, e, out: p.items.create(out, e),
    "conversation.item.truncate": lambda p, e, out: p.items.truncate(out, e),
    "conversation.item.delete": lambda p, e, out: p.items.delete(out, e),
    "conversation.item.retrieve": lambda p, e, out: p.items.retrieve(out, e),
    "response.create": RealtimeProtocol._on_response_create,
    "response.cancel": RealtimeProtocol._on_response_cancel,
}
