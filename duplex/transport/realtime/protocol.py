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
import itertools
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from duplex.media import (
    Resampler,
    alaw_decode,
    alaw_encode,
    float_to_pcm16,
    pcm16_to_float,
    ulaw_decode,
    ulaw_encode,
)
from duplex.media.pcm import PcmError
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.session.errors import SessionError
from duplex.session.pacing import OutputPacer
from duplex.session.state import Session
from duplex.session.turn_detection import TurnDetector
from duplex.transport.effects import (
    CloseConnection,
    EngineCancel,
    EngineClearInput,
    EngineCommit,
    EnginePush,
    EnginePushFrame,
    EnginePushImage,
    EnginePushText,
    FlushAudio,
    PlayAudio,
    Send,
    VadFeed,
)
from duplex.transport.realtime import schema

RATE = 24000
VAD_RATE = 16000
INPUT_TRACK = "input_audio"

_BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
_BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


@dataclass(frozen=True)
class ResumeSession:
    """Look the session up in the registry and claim it; answer with `resumed` or
    `resume_failed`."""

    session_id: str
    resume_token: str


Effect = (
    Send | EnginePush | EnginePushFrame | EnginePushText | EnginePushImage | EngineCommit
    | EngineCancel | EngineClearInput | VadFeed | PlayAudio | FlushAudio | CloseConnection
    | ResumeSession
)


@dataclass
class Limits:
    max_message_bytes: int = 1 << 20
    max_input_lead_ms: int = 5000
    """How far appended audio may run ahead of real time before appends are refused."""
    output_lead_ms: int = 200
    max_errors: int = 100
    """Errors one connection may cause before it is closed (1008) as abusive."""


@dataclass
class ItemRecord:
    id: str
    role: str
    content_type: str
    transcript: str | None = None
    text: str | None = None
    status: str = "completed"
    response_id: int | None = None

    def as_wire(self) -> dict[str, Any]:
        part: dict[str, Any] = {"type": self.content_type}
        if self.content_type in ("input_audio", "output_audio"):
            part["transcript"] = self.transcript
        else:
            part["text"] = self.text
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [part],
        }


@dataclass
class ActiveResponse:
    id: str
    core_id: int
    epoch: int
    item: ItemRecord
    engine_done: bool = False
    audio_started: bool = False
    transcript: list[str] = field(default_factory=list)


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


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
    ) -> None:
        self.session_id = session_id
        self.resume_token = resume_token
        """Sent once, in session.created (and session.resumed); the registry keeps its hash."""
        self.media_track = media_track
        """Reply audio goes to a paced media track (WebRTC) instead of audio delta events."""
        self.model = model
        self.beta = beta
        self.limits = limits or Limits()
        self.core = Session(session_id, sample_rate=RATE,
                            video_interval_samples=video_interval_samples)
        self.model_input_rate = model_input_rate
        self.model_output_rate = model_output_rate
        self.input_format = "audio/pcm"
        self.output_format = "audio/pcm"
        self.output_modalities = ["audio"]
        self.instructions = ""
        self.turn_detection: schema.TurnDetection | None = schema.TurnDetection(type="server_vad")
        self.detector = self._new_detector()
        self._to_model = Resampler(RATE, model_input_rate)
        self._to_vad = Resampler(RATE, VAD_RATE, quality="QQ")
        self._from_model = Resampler(model_output_rate, RATE)
        # G.711 is 8 kHz telephone audio: a quick filter loses nothing and adds no burst delay.
        self._g711_in = Resampler(8000, RATE, quality="QQ")
        self._g711_out = Resampler(RATE, 8000)
        self._ids = itertools.count(1)
        self.items: list[ItemRecord] = []
        self.response: ActiveResponse | None = None
        self.core_to_response: dict[int, ItemRecord] = {}
        self.pacer: OutputPacer[np.ndarray] = OutputPacer(self.limits.output_lead_ms * RATE // 1000)
        self.input_samples = 0
        self.uncommitted_samples = 0
        self.speech_item_id: str | None = None
        self.errors = 0
        self.client_events = 0
        self.closed = False

    # -- ids and event framing ---------------------------------------------------------------

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}{secrets.token_hex(4)}"

    def _event(self, type_: str, **fields: Any) -> Send | None:
        if self.beta:
            if type_ == "conversation.item.done":
                return None
            type_ = _BETA_NAMES.get(type_, type_)
        return Send({"type": type_, "event_id": self._id("event"), **fields})

    def _emit(self, out: list[Effect], type_: str, **fields: Any) -> None:
        event = self._event(type_, **fields)
        if event is not None:
            out.append(event)

    def _error(self, out: list[Effect], code: str, message: str, param: str | None = None,
               client_event_id: str | None = None, kind: str = "invalid_request_error") -> None:
        self.errors += 1
        self._emit(out, "error", error={
            "type": kind, "code": code, "message": message, "param": param,
            "event_id": client_event_id,
        })
        if self.errors > self.limits.max_errors and not self.closed:
            self.closed = True
            out.append(CloseConnection(1008, f"more than {self.limits.max_errors} errors"))

    def session_object(self) -> dict[str, Any]:
        if self.beta:
            flat = {v: k for k, v in _BETA_FORMATS.items()}
            return {
                "id": self.session_id,
                "object": "realtime.session",
                "model": self.model,
                "modalities": self.output_modalities,
                "instructions": self.instructions,
                "input_audio_format": flat[self.input_format],
                "output_audio_format": flat[self.output_format],
                "turn_detection": self._turn_detection_wire(),
            }
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.session_id,
            "model": self.model,
            "output_modalities": self.output_modalities,
            "instructions": self.instructions,
            "audio": {
                "input": {
                    "format": self._format_wire(self.input_format),
                    "turn_detection": self._turn_detection_wire(),
                },
                "output": {"format": self._format_wire(self.output_format)},
            },
        }

    @staticmethod
    def _format_wire(fmt: str) -> dict[str, Any]:
        return {"type": fmt, "rate": RATE} if fmt == "audio/pcm" else {"type": fmt}

    def _turn_detection_wire(self) -> dict[str, Any] | None:
        td = self.turn_detection
        return None if td is None else td.model_dump(exclude_none=True, exclude={"eagerness"})

    def _new_detector(self) -> TurnDetector:
        td = self.turn_detection or schema.TurnDetection(type="server_vad")
        return TurnDetector(
            threshold=td.threshold,
            silence_samples=td.silence_duration_ms * RATE // 1000,
            prefix_samples=td.prefix_padding_ms * RATE // 1000,
            position=getattr(self, "input_samples", 0),
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
        return out

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
        try:
            raw = json.loads(text)
        except ValueError as exc:
            self._error(out, "invalid_json", f"The message is not valid JSON: {exc}.")
            return out
        if not isinstance(raw, dict):
            self._error(out, "invalid_json", "The message must be a JSON object.")
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
        handler = getattr(self, "_on_" + type_.replace(".", "_"))
        try:
            handler(event, out)
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
                config: dict[str, Any]) -> list[Effect]:
        """The edge claimed `session_id`: continue its conversation on this connection.
        Nothing is replayed: items come back as they were heard and no audio is resent."""
        self.session_id = session_id
        self.core.id = session_id
        self.items = [
            ItemRecord(i["id"], i["role"], i["type"], transcript=i.get("transcript"),
                       text=i.get("text"),
                       status="incomplete" if i["status"] == "in_progress" else i["status"])
            for i in conversation
        ]
        updates = {k: config[k] for k in ("input_format", "output_format", "output_modalities",
                                          "instructions") if k in config}
        if "turn_detection" in config:
            td = config["turn_detection"]
            updates["turn_detection"] = None if td is None else schema.TurnDetection.model_validate(td)
        self._apply_updates(updates)
        out: list[Effect] = []
        self._emit(out, "session.resumed", session=self._session_with_token())
        return out

    def configure(self, session: dict[str, Any]) -> None:
        """Apply GA session settings without an event (an ephemeral key's, before
        session.created); raises ProtocolError."""
        self._apply_ga_session(session)

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
        for item in self.items:
            entry: dict[str, Any] = {"id": item.id, "role": item.role,
                                     "type": item.content_type, "status": item.status}
            if item.text is not None:
                entry["text"] = item.text
            transcript = self._heard_transcript(item, played)
            if transcript is not None:
                entry["transcript"] = transcript
            items.append(entry)
        td = self.turn_detection
        config = {
            "input_format": self.input_format,
            "output_format": self.output_format,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "turn_detection": None if td is None else td.model_dump(exclude_none=True),
        }
        return items, config

    def _heard_transcript(self, item: ItemRecord, played: int) -> str | None:
        if item.response_id is None or item.response_id >= len(self.core.responses):
            return item.transcript
        resp = self.core.responses[item.response_id]
        if resp.heard_samples is not None or played >= resp.start_sample + resp.sent_samples:
            return resp.transcript
        return resp.text_before(played - resp.start_sample)

    def _on_session_update(self, event: schema.SessionUpdate, out: list[Effect]) -> None:
        if self.beta:
            self._apply_beta_session(event.session)
        else:
            for flat in ("input_audio_format", "output_audio_format", "modalities"):
                if flat in event.session:
                    raise ProtocolError("unknown_parameter",
                                        f"Unknown parameter: 'session.{flat}'. Use session.audio "
                                        "(GA); beta spellings need the OpenAI-Beta: realtime=v1 "
                                        "header.", f"session.{flat}")
            self._apply_ga_session(event.session)
        self._emit(out, "session.updated", session=self.session_object())

    def _apply_ga_session(self, data: dict[str, Any]) -> None:
        try:
            cfg = schema.SessionConfig.model_validate(data)
        except ValidationError as exc:
            raise ProtocolError("invalid_value", *reversed(schema.first_problem(exc, "session."))) from None
        updates: dict[str, Any] = {}
        if cfg.output_modalities is not None:
            updates["output_modalities"] = list(cfg.output_modalities)
        if cfg.instructions is not None:
            updates["instructions"] = cfg.instructions
        audio = cfg.audio
        if audio and audio.input:
            if audio.input.format:
                updates["input_format"] = audio.input.format.type
            if "turn_detection" in audio.input.model_fields_set:
                updates["turn_detection"] = audio.input.turn_detection
        if audio and audio.output and audio.output.format:
            updates["output_format"] = audio.output.format.type
        self._apply_updates(updates)

    def _apply_beta_session(self, data: dict[str, Any]) -> None:
        try:
            cfg = schema.BetaSessionConfig.model_validate(data)
        except ValidationError as exc:
            raise ProtocolError("invalid_value", *reversed(schema.first_problem(exc, "session."))) from None
        updates: dict[str, Any] = {}
        if cfg.modalities is not None:
            updates["output_modalities"] = list(cfg.modalities)
        if cfg.instructions is not None:
            updates["instructions"] = cfg.instructions
        if cfg.input_audio_format:
            updates["input_format"] = _BETA_FORMATS[cfg.input_audio_format]
        if cfg.output_audio_format:
            updates["output_format"] = _BETA_FORMATS[cfg.output_audio_format]
        if "turn_detection" in cfg.model_fields_set:
            updates["turn_detection"] = cfg.turn_detection
        self._apply_updates(updates)

    def _apply_updates(self, updates: dict[str, Any]) -> None:
        if "output_format" in updates and self.response is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                "The output format cannot change while a response is playing.",
                                "session.audio.output.format")
        for key, value in updates.items():
            setattr(self, key, value)
        if "turn_detection" in updates:
            self.detector = self._new_detector()

    def _on_input_audio_buffer_append(self, event: schema.Append, out: list[Effect]) -> None:
        try:
            data = base64.b64decode(event.audio, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("invalid_value", "Invalid value for 'audio': not valid base64.",
                                "audio") from None
        try:
            pcm = self._decode_input(data)
        except PcmError as exc:
            raise ProtocolError("invalid_value", f"Invalid value for 'audio': {exc}.", "audio") from None
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
        out.append(EnginePush(self._to_model.process(pcm)))
        if self.turn_detection is not None:
            out.append(VadFeed(self._to_vad.process(pcm)))

    @property
    def _input_lead_samples(self) -> int:
        return self.input_samples - self.core.now_sample

    def _decode_input(self, data: bytes) -> np.ndarray:
        if self.input_format == "audio/pcm":
            return pcm16_to_float(data)
        decode = ulaw_decode if self.input_format == "audio/pcmu" else alaw_decode
        return self._g711_in.process(decode(data).astype(np.float32) / 32768.0)

    def _on_input_audio_buffer_commit(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        if self.uncommitted_samples < RATE // 10:
            raise ProtocolError("input_audio_buffer_commit_empty",
                                f"Error committing input audio buffer: buffer too small. Expected at "
                                f"least 100ms of audio, but buffer only has "
                                f"{self.uncommitted_samples * 1000 // RATE}ms of audio.")
        self._commit_user_audio(out, self.speech_item_id or self._id("item"))

    def _commit_user_audio(self, out: list[Effect], item_id: str) -> ItemRecord:
        previous = self.items[-1].id if self.items else None
        item = ItemRecord(item_id, "user", "input_audio", transcript=None)
        self.items.append(item)
        self.uncommitted_samples = 0
        self.speech_item_id = None
        self._emit(out, "input_audio_buffer.committed", item_id=item.id, previous_item_id=previous)
        self._emit(out, "conversation.item.added", item=item.as_wire(), previous_item_id=previous)
        self._emit(out, "conversation.item.done", item=item.as_wire(), previous_item_id=previous)
        return item

    def _on_input_audio_buffer_clear(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        self.uncommitted_samples = 0
        out.append(EngineClearInput())
        self._emit(out, "input_audio_buffer.cleared")

    def _on_output_audio_buffer_clear(self, event: schema.ClientEvent, out: list[Effect]) -> None:
        self._cancel(out, "client_cancelled")
        self._emit(out, "output_audio_buffer.cleared", response_id=None)

    def _on_conversation_item_create(self, event: schema.ItemCreate, out: list[Effect]) -> None:
        item = event.item
        if event.previous_item_id not in (None, "root") and not self._find(event.previous_item_id):
            raise ProtocolError("item_not_found", f"Item '{event.previous_item_id}' does not exist.",
                                "previous_item_id")
        item_id = item.id or self._id("item")
        if self._find(item_id):
            raise ProtocolError("item_already_exists", f"Item '{item_id}' already exists.", "item.id")
        first = item.content[0] if item.content else None
        if first is None:
            raise ProtocolError("invalid_value", "An item needs at least one content part.",
                                "item.content")
        record = ItemRecord(item_id, item.role, first.type, text=first.text,
                            transcript=first.transcript)
        if first.type == "input_audio":
            if first.audio is None:
                raise ProtocolError("missing_required_parameter",
                                    "Missing required parameter: 'item.content[0].audio'.",
                                    "item.content.0.audio")
            self._on_input_audio_buffer_append(schema.Append(type="x", audio=first.audio), out)
        elif first.type == "input_image":
            out.append(EnginePushImage(_image_bytes(first.image_url)))
        elif first.type in ("input_text", "text") and item.role == "user" and first.text:
            out.append(EnginePushText(first.text))
        previous = self.items[-1].id if self.items else None
        self.items.append(record)
        self._emit(out, "conversation.item.added", item=record.as_wire(), previous_item_id=previous)
        self._emit(out, "conversation.item.done", item=record.as_wire(), previous_item_id=previous)

    def _find(self, item_id: str | None) -> ItemRecord | None:
        return next((i for i in self.items if i.id == item_id), None)

    def _on_conversation_item_delete(self, event: schema.ItemRef, out: list[Effect]) -> None:
        item = self._find(event.item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"Item '{event.item_id}' does not exist.", "item_id")
        self.items.remove(item)
        self._emit(out, "conversation.item.deleted", item_id=item.id)

    def _on_conversation_item_retrieve(self, event: schema.ItemRef, out: list[Effect]) -> None:
        item = self._find(event.item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"Item '{event.item_id}' does not exist.", "item_id")
        self._emit(out, "conversation.item.retrieved", item=item.as_wire())

    def _on_conversation_item_truncate(self, event: schema.ItemTruncate, out: list[Effect]) -> None:
        item = self._find(event.item_id)
        if item is None or item.role != "assistant" or item.response_id is None:
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
        if self.response is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                f"Conversation already has an active response in progress: "
                                f"{self.response.id}. Wait until the response is finished before "
                                "creating a new one.")
        self._start_response(out)

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
        chunk = 512 * RATE // VAD_RATE
        for prob in probs:
            decision = self.detector.feed(prob, chunk)
            if isinstance(decision, cmd.SpeechStarted):
                self._speech_started(out, decision.at_sample)
            elif isinstance(decision, cmd.SpeechStopped):
                self._speech_stopped(out, decision.at_sample)
        return out

    def _speech_started(self, out: list[Effect], at: int) -> None:
        self.speech_item_id = self._id("item")
        start = max(0, at - self.detector.prefix_samples)
        self._emit(out, "input_audio_buffer.speech_started",
                   audio_start_ms=start * 1000 // RATE, item_id=self.speech_item_id)
        if self.response is not None and not self.turn_detection.interrupt_response:
            return
        # The core turns speech over a playing reply into a barge-in: epoch bump, flush,
        # transcript cut at the playback watermark.
        self._apply_core_events(out, self.core.handle(cmd.SpeechStarted(at)))

    def _speech_stopped(self, out: list[Effect], at: int) -> None:
        self._apply_core_events(out, self.core.handle(cmd.SpeechStopped(at)))
        item_id = self.speech_item_id or self._id("item")
        self._emit(out, "input_audio_buffer.speech_stopped", audio_end_ms=at * 1000 // RATE,
                   item_id=item_id)
        self._commit_user_audio(out, item_id)
        if self.turn_detection.create_response and self.response is None:
            self._start_response(out)

    # -- responses ------------------------------------------------------------------------

    def _start_response(self, out: list[Effect]) -> None:
        events = self.core.handle(cmd.StartResponse())
        started = next(e for e in events if isinstance(e, ev.ResponseStarted))
        previous = self.items[-1].id if self.items else None
        item = ItemRecord(self._id("item"), "assistant", "output_audio", transcript="",
                          status="in_progress", response_id=started.response_id)
        self.items.append(item)
        self.response = ActiveResponse(self._id("resp"), started.response_id, started.epoch, item)
        self._emit(out, "response.created", response=self._response_wire("in_progress"))
        self._emit(out, "conversation.item.added", item=item.as_wire(), previous_item_id=previous)
        self._emit(out, "response.output_item.added", response_id=self.response.id,
                   output_index=0, item=item.as_wire())
        self._emit(out, "response.content_part.added", response_id=self.response.id,
                   item_id=item.id, output_index=0, content_index=0,
                   part={"type": "audio", "transcript": ""})
        out.append(EngineCommit(started.epoch))

    def _response_wire(self, status: str, reason: str | None = None) -> dict[str, Any]:
        r = self.response
        details = None
        if status == "cancelled":
            details = {"type": "cancelled", "reason": reason, "error": None}
        return {
            "id": r.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [r.item.as_wire()] if status != "in_progress" else [],
            "output_modalities": self.output_modalities,
            "conversation_id": None,
            "usage": None,
            "audio": {"output": {"format": self._format_wire(self.output_format)}},
        }

    def _cancel(self, out: list[Effect], reason: str) -> None:
        if self.response is None:
            return
        events = self.core.handle(cmd.Cancel(reason))
        self._apply_core_events(out, events)

    def _apply_core_events(self, out: list[Effect], events: list[ev.Event]) -> None:
        for e in events:
            if isinstance(e, ev.EpochBumped):
                out.append(EngineCancel(e.new))
            elif isinstance(e, ev.Flush):
                self.pacer.flush()
                if self.media_track:
                    out.append(FlushAudio())
                self._from_model = Resampler(self.model_output_rate, RATE)
            elif isinstance(e, ev.TranscriptTruncated):
                record = self._item_of_core(e.response_id)
                if record is not None:
                    record.transcript = e.heard_text
            elif isinstance(e, ev.ResponseCancelled) and self.response is not None:
                r = self.response
                r.item.status = "incomplete"
                self._emit(out, "response.output_item.done", response_id=r.id, output_index=0,
                           item=r.item.as_wire())
                self._emit(out, "conversation.item.done", item=r.item.as_wire())
                reason = "turn_detected" if e.reason == "barge_in" else e.reason
                self._emit(out, "response.done", response=self._response_wire("cancelled", reason))
                self._emit(out, "output_audio_buffer.cleared", response_id=r.id)
                self.response = None
        self.pacer.rewind(self.core.sent_samples)

    def _item_of_core(self, core_id: int) -> ItemRecord | None:
        return next((i for i in self.items if i.response_id == core_id), None)

    # -- engine results and pacing ----------------------------------------------------------

    def on_engine_audio(self, epoch: int, pcm: np.ndarray, text: str) -> list[Effect]:
        out: list[Effect] = []
        r = self.response
        if r is None or epoch != r.epoch or self.closed:
            return out
        audio = self._from_model.process(pcm)
        events = self.core.handle(cmd.OutputChunkProduced(epoch, len(audio), text))
        for e in events:
            if isinstance(e, ev.OutputChunk):
                self.pacer.push(e, audio)
        return out

    def on_engine_finished(self, epoch: int) -> list[Effect]:
        r = self.response
        if r is not None and epoch == r.epoch:
            tail = self._from_model.process(np.zeros(0, np.float32), last=True)
            if len(tail):
                for e in self.core.handle(cmd.OutputChunkProduced(epoch, len(tail), "")):
                    if isinstance(e, ev.OutputChunk):
                        self.pacer.push(e, tail)
            self._from_model = Resampler(self.model_output_rate, RATE)
            r.engine_done = True
        return []

    def on_engine_failed(self, message: str) -> list[Effect]:
        """The model failed on this session: say so, end any reply, close with 1011."""
        out: list[Effect] = []
        if self.response is not None:
            self.pacer.flush()
            self.response.item.status = "incomplete"
            wire = self._response_wire("failed")
            wire["status_details"] = {"type": "failed", "reason": None,
                                      "error": {"type": "server_error", "code": "model_error"}}
            self._emit(out, "response.done", response=wire)
            self.response = None
        self._error(out, "model_error", f"The model failed on this session: {message}",
                    kind="server_error")
        self.closed = True
        out.append(CloseConnection(1011, "model error"))
        return out

    def on_engine_timings(self, timings: dict[str, float]) -> list[Effect]:
        """Per-stage latency of the current reply, for clients that show it (duplex extension)."""
        out: list[Effect] = []
        if self.response is not None:
            self._emit(out, "duplex.response.timings", response_id=self.response.id,
                       timings_ms=timings)
        return out

    def on_playback(self, played_sample: int) -> None:
        """The media track has played the output clock up to `played_sample`."""
        self.pacer.playhead = played_sample

    def release_output(self, now: int) -> list[Effect]:
        """Send the reply audio that is due at clock sample `now` (at most output_lead ahead)."""
        out: list[Effect] = []
        if self.closed:
            return out
        if now > self.core.now_sample:
            self.core.handle(cmd.Tick(now))
        for chunk, audio in self.pacer.due(now):
            self._send_chunk(out, chunk, audio)
        played = self.pacer.played(now)
        if played > self.core.played_samples:
            self.core.handle(cmd.PlaybackAcknowledged(played))
        r = self.response
        if r is not None and r.engine_done and not self.pacer:
            self._finish_response(out)
        return out

    def _send_chunk(self, out: list[Effect], chunk: ev.OutputChunk, audio: np.ndarray) -> None:
        r = self.response
        if self.media_track:
            if not r.audio_started:
                r.audio_started = True
                self._emit(out, "output_audio_buffer.started", response_id=r.id)
            out.append(PlayAudio(chunk.start_sample, audio))
        elif "audio" in self.output_modalities and len(audio):
            self._emit(out, "response.output_audio.delta", response_id=r.id, item_id=r.item.id,
                       output_index=0, content_index=0,
                       delta=base64.b64encode(self._encode_output(audio)).decode())
        if chunk.text:
            r.transcript.append(chunk.text)
            self._emit(out, "response.output_audio_transcript.delta", response_id=r.id,
                       item_id=r.item.id, output_index=0, content_index=0, delta=chunk.text)

    def _encode_output(self, audio: np.ndarray) -> bytes:
        if self.output_format == "audio/pcm":
            return float_to_pcm16(audio)
        pcm8k = np.frombuffer(float_to_pcm16(self._g711_out.process(audio)), dtype="<i2")
        return (ulaw_encode if self.output_format == "audio/pcmu" else alaw_encode)(pcm8k)

    def _finish_response(self, out: list[Effect]) -> None:
        r = self.response
        self.core.handle(cmd.ResponseCompleted(r.epoch))
        transcript = "".join(r.transcript)
        r.item.transcript = transcript
        r.item.status = "completed"
        common = {"response_id": r.id, "item_id": r.item.id, "output_index": 0}
        self._emit(out, "response.output_audio.done", **common, content_index=0)
        self._emit(out, "response.output_audio_transcript.done", **common, content_index=0,
                   transcript=transcript)
        self._emit(out, "response.content_part.done", **common, content_index=0,
                   part={"type": "audio", "transcript": transcript})
        self._emit(out, "response.output_item.done", response_id=r.id, output_index=0,
                   item=r.item.as_wire())
        self._emit(out, "conversation.item.done", item=r.item.as_wire())
        self._emit(out, "response.done", response=self._response_wire("completed"))
        if self.media_track and r.audio_started:
            self._emit(out, "output_audio_buffer.stopped", response_id=r.id)
        self.response = None

    def close(self) -> dict[str, int]:
        """Release everything; returns what the core held, by name."""
        self.closed = True
        self.pacer.flush()
        released = self.core.handle(cmd.Close())
        return dict(next(e for e in released if isinstance(e, ev.Released)).items)


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
