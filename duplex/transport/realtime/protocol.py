"""The OpenAI Realtime protocol as a pure state machine around the session core.

Text frames in (`receive_text`), engine results and VAD probabilities in, and out come plain
effects: server events to send, work for the engine, audio for the VAD, a close. The asyncio
edge (ws.py) carries them out; nothing here awaits, sleeps or touches a socket. Time enters
only as the sample count the edge passes to `release_output`, which paces reply audio.

All counts are samples on a 24 kHz session clock in both directions (the wire's own rate for
PCM; G.711's 8 kHz is resampled onto it), so audio_start_ms and audio_end_ms are exact.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pydantic import ValidationError

from duplex.engine.thinker_text import Piece
from duplex.media import (
    Resampler,
    g711_to_float,
    pcm16_to_float,
)
from duplex.media.pcm import PcmError
from duplex.media.rates import ASR_RATE
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
    EnginePush,
    EnginePushFrame,
    EnginePushImage,
    EnginePushText,
    EngineSetDuplex,
    FlushAudio,
    InterruptionJudged,
    InvalidToolCall,
    PlayAudio,
    Send,
    VadFeed,
)
from duplex.transport.realtime import schema
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.duplex_mode import (
    BETA_PARAM,
    MODEL_PARAM,
    NATIVE_MODELS,
    DuplexSegments,
    SegmentAudio,
    SegmentEnd,
    SegmentStart,
    not_native,
)
from duplex.transport.realtime.events import ActiveResponse, EventWriter
from duplex.transport.realtime.replies import G711_LAWS, Replies
from duplex.transport.realtime.session_config import (
    RESUME_GAP_MS,
    ConfigError,
    ResponseSettings,
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

INPUT_TRACK = "input_audio"
OPENAI_TRANSCRIBE = "whisper-1"
"""What a transcription config without a model asks for: the server's configured recogniser."""



@dataclass(frozen=True)
class Transcribe:
    """Recognise `pcm` (float32 at 16 kHz), the audio of user item `item_id`, with `model`;
    answer with `on_transcript`."""

    item_id: str
    model: str
    pcm: np.ndarray


@dataclass(frozen=True)
class ResumeSession:
    """Look the session up in the registry and claim it; answer with `resumed` or
    `resume_failed`."""

    session_id: str
    resume_token: str


Effect = (
    Send | EnginePush | EnginePushFrame | EnginePushText | EnginePushImage | EngineCommit
    | EngineCancel | EngineClearInput | VadFeed | PlayAudio | FlushAudio | CloseConnection
    | ResumeSession | InvalidToolCall | EngineInstruct | Transcribe | EngineSetDuplex
    | InterruptionJudged
)


@dataclass
class Limits:
    max_message_bytes: int = 1 << 20
    max_input_lead_ms: int = 5000
    """How far appended audio may run ahead of real time before appends are refused."""
    output_lead_ms: int = 200
    max_errors: int = 100
    """Errors one connection may cause before it is closed (1008) as abusive."""


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param

    @classmethod
    def of(cls, exc: ConfigError) -> ProtocolError:
        return cls(exc.code, str(exc), exc.param)


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
        native_duplex: bool = False,
        duplex_models: tuple[str, ...] = NATIVE_MODELS,
        start_duplex: bool = False,
    ) -> None:
        self.session_id = session_id
        self.resume_token = resume_token
        """Sent once, in session.created (and session.resumed); the registry keeps its hash."""
        self.media_track = media_track
        """Reply audio goes to a paced media track (WebRTC) instead of audio delta events."""
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
        self.transcription_models = transcription_models
        self.native_duplex = native_duplex
        """Whether the model runs native full duplex (`turn_detection: {"type": "duplex"}`)."""
        self.duplex_models = duplex_models
        """The models that can, named in the error a turn-based model answers with."""
        self.segments: DuplexSegments | None = None
        """The model's spoken segments while the session runs duplex; None for turns."""
        self.duplex_dropped: dict[str, int] = {}
        """Input samples the engine skipped in duplex, by reason (it fell behind)."""
        """The names `audio.input.transcription.model` may take; empty: no recogniser."""
        self._to_asr = Resampler(RATE, ASR_RATE)
        self._asr_audio: list[np.ndarray] = []
        """Uncommitted input at the recogniser's rate, kept only while transcription is on."""
        self.input_samples = 0
        self._told_instructions: tuple[str, tuple] = ("", ())
        """The instructions and tools the engine was last told (EngineInstruct)."""
        self._idle_since: int | None = None
        """Clock sample since which nothing has happened, for turn_detection.idle_timeout_ms."""
        self.clock = MediaClock(
            session_id, rate=RATE, model_input_rate=model_input_rate,
            model_output_rate=model_output_rate,
            lead_samples=self.limits.output_lead_ms * RATE // 1000,
            detector=self._new_detector(), video_interval_samples=video_interval_samples,
        )
        self.core = self.clock.core
        self.pacer = self.clock.pacer
        self._held_onset: int | None = None
        """Onset of speech that paused the reply, whose speech_started waits for its judgement."""
        self._apply_interruption()
        # G.711 is 8 kHz telephone audio: a quick filter loses nothing and adds no burst delay.
        self._g711_in = Resampler(8000, RATE, quality="QQ")
        self.events = EventWriter(beta)
        self.conversation = Conversation()
        self.replies = Replies(self.clock, self.events, self.conversation, self.voices,
                               media_track=media_track, conversation_id=_conversation_id(session_id))
        self.uncommitted_samples = 0
        self.speech_item_id: str | None = None
        self.errors = 0
        self.client_events = 0
        self.closed = False

    # -- ids and event framing ---------------------------------------------------------------

    def _id(self, prefix: str) -> str:
        return self.events.new_id(prefix)

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

    def _new_detector(self) -> TurnDetector:
        td = self.turn_detection or schema.TurnDetection(type="server_vad")
        return TurnDetector(
            threshold=td.threshold,
            silence_samples=silence_ms(td) * RATE // 1000,
            prefix_samples=td.prefix_padding_ms * RATE // 1000,
            position=self.input_samples,
        )

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
        self._sync_duplex(out)
        return out

    def _instruct(self, out: list[Effect]) -> None:
        """Tell the engine the session's instructions and tools when they change, so the
        model can place its system turn before any input (see `DuplexModel.instruct`)."""
        told = (self.settings.instructions, self.settings.tools)
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

    # -- client events --------------------------------------------------------------------

    def _on_session_resume(self, event: schema.SessionResume, out: list[Effect]) -> None:
        # Later, the fresh session has already taken input the resumed one never saw.
        if self.client_events != 1:
            raise ProtocolError("session_resume_not_first",
                                "session.resume must be the first event on a connection.", "type")
        out.append(ResumeSession(event.session_id, event.resume_token))

    def resumed(self, session_id: str, conversation: list[dict[str, Any]],
                config: dict[str, Any], context: dict[str, Any] | None = None) -> list[Effect]:
        """The edge claimed `session_id`: continue its conversation on this connection.
        Nothing is replayed: items come back as they were heard and no audio is resent.

        `context` says how much of the model's context the edge put back (the extension field
        `rebuilt_context`); the engine then holds the system turn that context opened with,
        and the session's instructions reach it with the next reply, as they did before."""
        self.session_id = session_id
        self.core.id = session_id
        self.replies.conversation_id = _conversation_id(session_id)
        self.conversation.replace_all([Item.from_record(i) for i in conversation])
        self._set_settings(SessionSettings.from_record(config))
        out: list[Effect] = []
        fields: dict[str, Any] = {"session": self._session_with_token()}
        if context is not None:
            fields["rebuilt_context"] = context
        self._emit(out, "session.resumed", **fields)
        if context is not None and context["items"]:
            self._told_instructions = (self.settings.instructions, self.settings.tools)
        else:
            self._instruct(out)
        self._sync_duplex(out)
        return out

    def continue_epoch(self, epoch: int) -> None:
        """This connection took over the engine session a dropped one left at `epoch` (a
        resume on the node that kept it): replies go on from that epoch."""
        self.core.epoch = epoch

    def configure(self, session: dict[str, Any]) -> None:
        """Apply GA session settings without an event (an ephemeral key's, before
        session.created); raises ProtocolError."""
        try:
            new = updated_ga(self.settings, session)
        except ConfigError as exc:
            raise ProtocolError.of(exc) from None
        self._check_duplex(new)
        self._set_settings(new)

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

    def snapshot(self, now: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The conversation as heard at clock sample `now`, and the session's settings: what a
        resume (on any node) continues from."""
        played = self.pacer.played(now)
        items = []
        for item in self.conversation:
            record = item.record()
            transcript = self._heard_transcript(item, played)
            if transcript is not None:
                record["transcript"] = transcript
            items.append(record)
        return items, self.settings.record()

    def heard(self, core_id: int, now: int) -> int | None:
        """Samples of reply `core_id` heard at clock sample `now`; None when all of it was."""
        if core_id >= len(self.core.responses):
            return None
        resp = self.core.responses[core_id]
        if resp.heard_samples is not None:
            return resp.heard_samples
        played = self.pacer.played(now) - resp.start_sample
        if not resp.generating and played >= resp.sent_samples:
            return None
        return max(0, played)

    def _heard_transcript(self, item: Item, played: int) -> str | None:
        if item.response_id is None or item.response_id >= len(self.core.responses):
            return item.transcript
        resp = self.core.responses[item.response_id]
        if resp.heard_samples is not None or played >= resp.start_sample + resp.sent_samples:
            return resp.transcript
        return resp.text_before(played - resp.start_sample)

    def _on_session_update(self, event: schema.SessionUpdate, out: list[Effect]) -> None:
        update = updated_beta if self.beta else updated_ga
        try:
            new = update(self.settings, event.session)
        except ConfigError as exc:
            raise ProtocolError.of(exc) from None
        self._check_transcription(new)
        self._check_duplex(new)
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
        self._instruct(out)
        self._sync_duplex(out)

    def _check_duplex(self, new: SessionSettings) -> None:
        td = new.turn_detection
        if td is not None and td.type == "duplex" and not self.native_duplex:
            param = BETA_PARAM if self.beta else MODEL_PARAM
            raise ProtocolError("invalid_value", not_native(self.model, param, self.duplex_models),
                                param)

    def _sync_duplex(self, out: list[Effect]) -> None:
        """Tell the engine when the session starts or stops running native duplex."""
        td = self.turn_detection
        want = td is not None and td.type == "duplex"
        if want == (self.segments is not None):
            if want:
                self.segments.silence_samples = self._silence_samples(td)
            return
        if self.response is not None:
            # A reply of the other mode would never end in this one.
            self._cancel(out, "turn_detection_changed")
        self.segments = DuplexSegments(self._silence_samples(td)) if want else None
        out.append(EngineSetDuplex(want))

    def _silence_samples(self, td: schema.TurnDetection) -> int:
        """The model's silence (at its output rate) that ends its spoken segment."""
        return max(1, td.silence_duration_ms * self.clock.model_output_rate // 1000)

    def duplex_refused(self, message: str) -> list[Effect]:
        """The engine has no room for one more duplex session: the session goes on by turns."""
        out: list[Effect] = []
        self.segments = None
        self._set_settings(replace(self.settings,
                                   turn_detection=schema.TurnDetection(type="server_vad")))
        self._error(out, "session_limit_reached", message, kind="server_error")
        self._emit(out, "session.updated", session=self.session_object())
        return out

    def _check_transcription(self, new: SessionSettings) -> None:
        if new.transcription is None or new.transcription == self.settings.transcription:
            return
        param = ("session.input_audio_transcription.model" if self.beta
                 else "session.audio.input.transcription.model")
        model = new.transcription.get("model")
        if not self.transcription_models:
            raise ProtocolError("invalid_value", "This server has no speech recogniser; "
                                "input audio transcription is not available.", param)
        if model is not None and model not in self.transcription_models:
            raise ProtocolError("invalid_value",
                                f"Invalid value for '{param}': unknown transcription model "
                                f"'{model}'; available: {', '.join(self.transcription_models)}.",
                                param)

    def _set_settings(self, new: SessionSettings) -> None:
        detection_changed = new.turn_detection != self.settings.turn_detection
        self.settings = new
        if detection_changed:
            self.clock.detector = self._new_detector()
        self._apply_interruption()

    def _apply_interruption(self) -> None:
        """turn_detection.min_interruption_ms and audio.input.noise_reduction, into the core and
        the echo guard."""
        self.core.handle(cmd.SetInterruption(
            min_interruption_ms(self.turn_detection) * RATE // 1000, RESUME_GAP_MS * RATE // 1000))
        self.clock.guard.set_strength(noise_reduction_type(self.settings))

    def _on_input_audio_buffer_append(self, event: schema.Append, out: list[Effect]) -> None:
        self._append_base64(event.audio, "audio", out)

    def _append_base64(self, audio: str, param: str, out: list[Effect]) -> None:
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("invalid_value", f"Invalid value for '{param}': not valid base64.",
                                param) from None
        try:
            pcm = self._decode_input(data)
        except PcmError as exc:
            raise ProtocolError("invalid_value", f"Invalid value for '{param}': {exc}.",
                                param) from None
        self._input_audio(pcm, out)

    def receive_audio(self, pcm: np.ndarray) -> list[Effect]:
        """Audio from a media track (WebRTC), float32 at 24 kHz: the same path as an append."""
        out: list[Effect] = []
        if not self.closed:
            try:
                self._input_audio(pcm, out)
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

    def _input_audio(self, pcm: np.ndarray, out: list[Effect]) -> None:
        n = len(pcm)
        self.core.handle(cmd.AudioReceived(INPUT_TRACK, n))
        if self._input_lead_samples + n > self.limits.max_input_lead_ms * RATE // 1000:
            self.core.handle(cmd.InputDropped(INPUT_TRACK, n, "faster_than_real_time"))
            raise ProtocolError("input_rate_exceeded",
                                f"Audio is being appended faster than real time (more than "
                                f"{self.limits.max_input_lead_ms} ms ahead); this chunk was dropped.",
                                "audio")
        self.input_samples += n
        self.uncommitted_samples += n
        self.core.handle(cmd.InputConsumed(INPUT_TRACK, n))
        if n == 0:
            return
        out += self.clock.input_effects(pcm, detect_speech=self.turn_detection is not None)
        if self.settings.transcription is not None:
            self._asr_audio.append(self._to_asr.process(pcm))

    @property
    def _input_lead_samples(self) -> int:
        return self.input_samples - self.core.now_sample

    def _decode_input(self, data: bytes) -> np.ndarray:
        fmt = self.settings.input_format
        if fmt == "audio/pcm":
            return pcm16_to_float(data)
        return self._g711_in.process(g711_to_float(data, G711_LAWS[fmt]))

    def _on_input_audio_buffer_commit(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        if self.uncommitted_samples < RATE // 10:
            raise ProtocolError("input_audio_buffer_commit_empty",
                                f"Error committing input audio buffer: buffer too small. Expected at "
                                f"least 100ms of audio, but buffer only has "
                                f"{self.uncommitted_samples * 1000 // RATE}ms of audio.")
        self._commit_user_audio(out, self.speech_item_id or self._id("item"))

    def _commit_user_audio(self, out: list[Effect], item_id: str) -> Item:
        item = Item(item_id, role="user", content_type="input_audio")
        previous = self.conversation.append(item)
        self.uncommitted_samples = 0
        self.speech_item_id = None
        self._emit(out, "input_audio_buffer.committed", item_id=item.id, previous_item_id=previous)
        self._emit(out, "conversation.item.added", item=item.as_wire(), previous_item_id=previous)
        self._emit(out, "conversation.item.done", item=item.as_wire(), previous_item_id=previous)
        self._transcribe(out, item)
        return item

    def _transcribe(self, out: list[Effect], item: Item) -> None:
        """The item's audio goes to the recogniser (its transcript comes back later)."""
        audio, self._asr_audio = self._asr_audio, []
        config = self.settings.transcription
        if config is None:
            return
        tail = self._to_asr.process(np.zeros(0, np.float32), last=True)
        self._to_asr = Resampler(RATE, ASR_RATE)
        pcm = np.concatenate([*audio, tail]) if audio else tail
        out.append(Transcribe(item.id, config.get("model") or OPENAI_TRANSCRIBE, pcm))

    def on_transcript(self, item_id: str, text: str | None, error: str | None,
                      audio_s: float) -> list[Effect]:
        """The recogniser's answer for a user audio item: its transcript, or why there is none."""
        out: list[Effect] = []
        item = self.conversation.find(item_id)
        if self.closed:
            return out
        if error is not None:
            self._emit(out, "conversation.item.input_audio_transcription.failed", item_id=item_id,
                       content_index=0, error={"type": "server_error", "code": "transcription_failed",
                                               "message": error, "param": None})
            return out
        if item is not None:
            item.transcript = text
        self._emit(out, "conversation.item.input_audio_transcription.delta", item_id=item_id,
                   content_index=0, delta=text)
        self._emit(out, "conversation.item.input_audio_transcription.completed", item_id=item_id,
                   content_index=0, transcript=text,
                   usage={"type": "duration", "seconds": round(audio_s, 3)})
        return out

    def _on_input_audio_buffer_clear(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        self.uncommitted_samples = 0
        self._asr_audio = []
        out.append(EngineClearInput())
        self._emit(out, "input_audio_buffer.cleared")

    def _on_output_audio_buffer_clear(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        self._cancel(out, "client_cancelled")
        self._emit(out, "output_audio_buffer.cleared", response_id=None)

    def _on_conversation_item_create(self, event: schema.ItemCreate, out: list[Effect]) -> None:
        kind = event.item.get("type", "message")
        model = schema.ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ProtocolError("invalid_value",
                                f"Invalid value for 'item.type': {kind!r} is not one of "
                                f"{', '.join(schema.ITEM_TYPES)}.", "item.type")
        try:
            item = model.model_validate(event.item)
        except ValidationError as exc:
            raise ProtocolError("invalid_value", *reversed(schema.first_problem(exc, "item."))) from None
        after = event.previous_item_id
        if after not in (None, "root") and self.conversation.find(after) is None:
            raise ProtocolError("item_not_found", f"Item '{after}' does not exist.",
                                "previous_item_id")
        item_id = item.id or self._id("item")
        if self.conversation.find(item_id):
            raise ProtocolError("item_already_exists", f"Item '{item_id}' already exists.", "item.id")
        if isinstance(item, schema.MessageItem):
            record = self._message_item(item_id, item, out)
        elif isinstance(item, schema.FunctionCallItem):
            record = Item(item_id, type="function_call", call_id=item.call_id, name=item.name,
                          arguments=item.arguments)
        else:
            if not any(i.type == "function_call" and i.call_id == item.call_id
                       for i in self.conversation):
                raise ProtocolError("invalid_value",
                                    f"Invalid value for 'item.call_id': no function call with "
                                    f"call_id '{item.call_id}' in the conversation.",
                                    "item.call_id")
            record = Item(item_id, type="function_call_output", call_id=item.call_id,
                          output=item.output)
            out.append(EnginePushText(item.output, role="tool"))
        previous = self.conversation.insert(record, after)
        self._emit(out, "conversation.item.added", item=record.as_wire(), previous_item_id=previous)
        self._emit(out, "conversation.item.done", item=record.as_wire(), previous_item_id=previous)

    def _message_item(self, item_id: str, item: schema.MessageItem, out: list[Effect]) -> Item:
        first = item.content[0] if item.content else None
        if first is None:
            raise ProtocolError("invalid_value", "An item needs at least one content part.",
                                "item.content")
        if first.type == "input_audio":
            if first.audio is None:
                raise ProtocolError("missing_required_parameter",
                                    "Missing required parameter: 'item.content[0].audio'.",
                                    "item.content.0.audio")
            self._append_base64(first.audio, "item.content.0.audio", out)
            record = Item(item_id, role=item.role, content_type=first.type,
                          transcript=first.transcript)
            self._transcribe(out, record)
            return record
        elif first.type == "input_image":
            out.append(EnginePushImage(_image_bytes(first.image_url)))
        elif first.type in ("input_text", "text") and item.role == "user" and first.text:
            out.append(EnginePushText(first.text))
        return Item(item_id, role=item.role, content_type=first.type, text=first.text,
                    transcript=first.transcript)

    def _on_conversation_item_delete(self, event: schema.ItemRef, out: list[Effect]) -> None:
        item = self.conversation.find(event.item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"Item '{event.item_id}' does not exist.", "item_id")
        self.conversation.remove(item)
        self._emit(out, "conversation.item.deleted", item_id=item.id)

    def _on_conversation_item_retrieve(self, event: schema.ItemRef, out: list[Effect]) -> None:
        item = self.conversation.find(event.item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"Item '{event.item_id}' does not exist.", "item_id")
        self._emit(out, "conversation.item.retrieved", item=item.as_wire())

    def _on_conversation_item_truncate(self, event: schema.ItemTruncate, out: list[Effect]) -> None:
        item = self.conversation.find(event.item_id)
        if item is None or item.response_id is None or item.content_type != "output_audio":
            raise ProtocolError("item_not_found",
                                f"No assistant audio item '{event.item_id}' to truncate.", "item_id")
        if event.content_index != 0:
            raise ProtocolError("invalid_value", "Only content_index 0 holds audio.", "content_index")
        if self.response is not None and self.response.item is item:
            self._cancel(out, "client_cancelled")
        end = event.audio_end_ms * RATE // 1000
        try:
            events = self.core.handle(cmd.Truncate(item.response_id, end))
        except SessionError as exc:
            raise ProtocolError("invalid_value", f"Invalid value for 'audio_end_ms': {exc}.",
                                "audio_end_ms") from None
        for e in events:
            if isinstance(e, ev.TranscriptTruncated):
                item.transcript = e.heard_text
        self.pacer.rewind(self.core.sent_samples)
        self._emit(out, "conversation.item.truncated", item_id=item.id, content_index=0,
                   audio_end_ms=event.audio_end_ms)

    def _on_response_create(self, event: schema.ResponseCreate, out: list[Effect]) -> None:
        if self.segments is not None:
            raise ProtocolError("invalid_request_error",
                                "In duplex mode the model decides when to speak; "
                                "response.create is not available.")
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
        except ConfigError as exc:
            raise ProtocolError.of(exc) from None
        self._start_response(out, settings)

    def _on_response_cancel(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        if self.response is None:
            raise ProtocolError("response_cancel_not_active",
                                "Cancellation failed: no active response found.")
        self._cancel(out, "client_cancelled")

    # -- turn detection -------------------------------------------------------------------

    def on_vad(self, probs: list[float]) -> list[Effect]:
        out: list[Effect] = []
        if self.turn_detection is None or self.closed:
            return out
        for command in self.clock.speech_decisions(probs):
            if self.segments is not None:
                if isinstance(command, (cmd.SpeechStarted, cmd.SpeechStopped)):
                    self._duplex_speech(out, command)
            elif isinstance(command, cmd.SpeechStarted):
                self._speech_started(out, command.at_sample)
            elif isinstance(command, cmd.SpeechStopped):
                self._speech_stopped(out, command.at_sample)
            else:
                self._judge(out, self.core.handle(command))
        return out

    def _speech_started(self, out: list[Effect], at: int) -> None:
        self.speech_item_id = self._id("item")
        if self.response is not None and not self.turn_detection.interrupt_response:
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

    def _announce_speech(self, out: list[Effect], at: int) -> None:
        self._held_onset = None
        start = max(0, at - self.detector.prefix_samples)
        self._emit(out, "input_audio_buffer.speech_started",
                   audio_start_ms=start * 1000 // RATE, item_id=self.speech_item_id)

    def _judge(self, out: list[Effect], events: list[ev.Event]) -> None:
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
                self.speech_item_id = None
                self.clock.forget_speech()
                self._duplex_event(out, "duplex.output.resumed",
                                   audio_start_ms=e.onset * 1000 // RATE,
                                   audio_end_ms=e.speech_end * 1000 // RATE)
        self._apply_core_events(out, events)

    def _duplex_event(self, out: list[Effect], type_: str, **fields: Any) -> None:
        if self.settings.duplex_events:
            response_id = self.response.id if self.response is not None else None
            self._emit(out, type_, response_id=response_id, **fields)

    def _duplex_speech(self, out: list[Effect], decision) -> None:
        """In duplex, user speech is information: it neither interrupts nor ends a turn (the
        model hears it in the same frames and decides)."""
        if isinstance(decision, cmd.SpeechStarted):
            self.speech_item_id = self._id("item")
            start = max(0, decision.at_sample - self.detector.prefix_samples)
            self._emit(out, "input_audio_buffer.speech_started",
                       audio_start_ms=start * 1000 // RATE, item_id=self.speech_item_id)
        else:
            self._emit(out, "input_audio_buffer.speech_stopped",
                       audio_end_ms=decision.at_sample * 1000 // RATE,
                       item_id=self.speech_item_id or self._id("item"))
            self.speech_item_id = None

    def _speech_stopped(self, out: list[Effect], at: int) -> None:
        events = self.core.handle(cmd.SpeechStopped(at))
        self._judge(out, events)
        if any(isinstance(e, ev.OutputResumed) for e in events):
            return
        item_id = self.speech_item_id or self._id("item")
        self._emit(out, "input_audio_buffer.speech_stopped", audio_end_ms=at * 1000 // RATE,
                   item_id=item_id)
        self._commit_user_audio(out, item_id)
        if self.turn_detection.create_response and self.response is None:
            self._start_response(out, response_settings(self.settings, None, self.beta))
        self._idle_since = None

    # -- replies: the output side lives in Replies ----------------------------------------

    @property
    def response(self) -> ActiveResponse | None:
        return self.replies.active

    def _start_response(self, out: list[Effect], settings: ResponseSettings) -> None:
        self.replies.start(out, settings)

    def _cancel(self, out: list[Effect], reason: str) -> None:
        self.replies.cancel(out, reason)
        if self.segments is not None:
            self.segments.cancel(self.core.epoch)

    def _apply_core_events(self, out: list[Effect], events: list[ev.Event]) -> None:
        self.replies.apply_core_events(out, events)

    def on_engine_audio(self, epoch: int, pcm: np.ndarray, text: str) -> list[Effect]:
        if not self.closed:
            self.replies.on_audio(epoch, pcm, text)
        return []

    def on_engine_duplex(self, epoch: int, pcm: np.ndarray, text: str, voiced: bool,
                         at: int = 0) -> list[Effect]:
        """One output frame of a duplex model, its first sample at `at` on the session's
        timeline (model output rate): spoken segments become responses."""
        out: list[Effect] = []
        if self.closed or self.segments is None:
            return out
        for action in self.segments.frame(epoch, pcm, text, voiced, at):
            if isinstance(action, SegmentStart):
                if self.response is None:
                    settings = response_settings(self.settings, None, self.beta)
                    self.replies.start(out, settings, commit=False)
                    self._segment_placed(out, action.at)
            elif isinstance(action, SegmentAudio):
                self.replies.on_audio(action.epoch, action.pcm, action.text)
            elif isinstance(action, SegmentEnd):
                self.replies.on_finished(action.epoch, "completed")
        return out

    def _segment_placed(self, out: list[Effect], at: int) -> None:
        """Where the reply starts on the input timeline, for clients that asked for duplex's
        own events: output frame k lies at input frame k + the model's delay."""
        if self.settings.duplex_events and self.response is not None:
            self._emit(out, "duplex.response.placed", response_id=self.response.id,
                       audio_start_ms=at * 1000 // self.clock.model_output_rate)

    def on_duplex_dropped(self, n_samples: int, reason: str) -> list[Effect]:
        self.duplex_dropped[reason] = self.duplex_dropped.get(reason, 0) + n_samples
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

    def on_playback(self, played_sample: int) -> None:
        """The media track has played the output clock up to `played_sample`."""
        self.pacer.playhead = played_sample

    def release_output(self, now: int) -> list[Effect]:
        """Send the reply audio that is due at clock sample `now` (at most output_lead ahead)."""
        out: list[Effect] = []
        if not self.closed:
            self.replies.release(out, now)
            self._check_idle(out, now)
        return out

    def _check_idle(self, out: list[Effect], now: int) -> None:
        """turn_detection.idle_timeout_ms: after that long with neither speech nor a reply, the
        server says so, commits what it has and (with create_response) replies, once."""
        td = self.turn_detection
        busy = (self.response is not None or self.detector.speaking
                or self.core.unplayed_samples or self.closed)
        if td is None or td.idle_timeout_ms is None or busy:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
            return
        if now - self._idle_since < td.idle_timeout_ms * RATE // 1000:
            return
        item_id = self._id("item")
        self._emit(out, "input_audio_buffer.timeout_triggered",
                   audio_start_ms=self._idle_since * 1000 // RATE, audio_end_ms=now * 1000 // RATE,
                   item_id=item_id)
        self._commit_user_audio(out, item_id)
        if td.create_response:
            self._start_response(out, response_settings(self.settings, None, self.beta))
        self._idle_since = None

    def close(self) -> dict[str, int]:
        """Release everything; returns what the core held, by name."""
        self.closed = True
        self.pacer.flush()
        released = self.core.handle(cmd.Close())
        held = dict(next(e for e in released if isinstance(e, ev.Released)).items)
        held.update({f"duplex_dropped:{reason}": n for reason, n in self.duplex_dropped.items()})
        return held


_EAGERNESS_SILENCE_MS = {"low": 1500, "medium": 800, "auto": 800, "high": 300}
"""semantic_vad's eagerness as the silence that ends a turn: no model here judges whether a
sentence is complete, so eagerness is how long a pause must be before the turn ends."""


def silence_ms(td: schema.TurnDetection) -> int:
    if td.type == "semantic_vad":
        return _EAGERNESS_SILENCE_MS[td.eagerness or "auto"]
    return td.silence_duration_ms


def _conversation_id(session_id: str) -> str:
    return "conv_" + session_id.removeprefix("sess_")


def _image_bytes(image_url: str | None) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; fetching URLs is not something we do."""
    if not image_url:
        raise ProtocolError("missing_required_parameter",
                            "Missing required parameter: 'item.content[0].image_url'.",
                            "item.content.0.image_url")
    head, _, payload = image_url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ProtocolError("invalid_value",
                            "Invalid value for 'image_url': only data:image/...;base64 URLs are "
                            "accepted.", "item.content.0.image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_value", "Invalid value for 'image_url': not valid base64.",
                            "item.content.0.image_url") from None


_HANDLERS = {
    "session.resume": RealtimeProtocol._on_session_resume,
    "session.update": RealtimeProtocol._on_session_update,
    "input_audio_buffer.append": RealtimeProtocol._on_input_audio_buffer_append,
    "input_audio_buffer.commit": RealtimeProtocol._on_input_audio_buffer_commit,
    "input_audio_buffer.clear": RealtimeProtocol._on_input_audio_buffer_clear,
    "output_audio_buffer.clear": RealtimeProtocol._on_output_audio_buffer_clear,
    "conversation.item.create": RealtimeProtocol._on_conversation_item_create,
    "conversation.item.truncate": RealtimeProtocol._on_conversation_item_truncate,
    "conversation.item.delete": RealtimeProtocol._on_conversation_item_delete,
    "conversation.item.retrieve": RealtimeProtocol._on_conversation_item_retrieve,
    "response.create": RealtimeProtocol._on_response_create,
    "response.cancel": RealtimeProtocol._on_response_cancel,
}
