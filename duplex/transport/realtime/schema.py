"""Client event schemas (GA, with the beta spellings a `realtime=v1` client sends).

Unknown fields are allowed, as the hosted API tolerates fields it does not use; wrong types,
missing required fields and unknown enum values are errors naming the parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class AudioFormat(_Loose):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]
    rate: Literal[24000] | None = None


class TurnDetection(_Loose):
    type: Literal["server_vad", "semantic_vad"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    prefix_padding_ms: Annotated[int, Field(ge=0, le=10_000)] = 300
    silence_duration_ms: Annotated[int, Field(ge=0, le=10_000)] = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None


class AudioInput(_Loose):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = None


class AudioOutput(_Loose):
    format: AudioFormat | None = None
    voice: str | None = None
    speed: float | None = None


class Audio(_Loose):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class SessionConfig(_Loose):
    type: Literal["realtime"] | None = None
    output_modalities: list[Literal["audio", "text"]] | None = None
    audio: Audio | None = None
    instructions: str | None = None


class BetaSessionConfig(_Loose):
    modalities: list[Literal["audio", "text"]] | None = None
    input_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | None = None
    output_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | None = None
    turn_detection: TurnDetection | None = None
    instructions: str | None = None
    voice: str | None = None


class ContentPart(_Loose):
    type: Literal["input_text", "input_audio", "input_image", "text", "output_text", "output_audio"]
    text: str | None = None
    audio: str | None = None
    image_url: str | None = None
    transcript: str | None = None


class Item(_Loose):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system"]
    content: list[ContentPart]


class ClientEvent(_Loose):
    type: str
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    session: dict[str, Any]


class Append(ClientEvent):
    audio: str


class ItemCreate(ClientEvent):
    item: Item
    previous_item_id: str | None = None


class ItemTruncate(ClientEvent):
    item_id: str
    content_index: Annotated[int, Field(ge=0)]
    audio_end_ms: Annotated[int, Field(ge=0)]


class ItemRef(ClientEvent):
    item_id: str


class ResponseCreate(ClientEvent):
    response: dict[str, Any] | None = None


class SessionResume(ClientEvent):
    """duplex extension: continue a session after a lost connection, on any node."""

    session_id: str
    resume_token: str


CLIENT_EVENTS: dict[str, type[ClientEvent]] = {
    "session.resume": SessionResume,
    "session.update": SessionUpdate,
    "input_audio_buffer.append": Append,
    "input_audio_buffer.commit": ClientEvent,
    "input_audio_buffer.clear": ClientEvent,
    "output_audio_buffer.clear": ClientEvent,
    "conversation.item.create": ItemCreate,
    "conversation.item.truncate": ItemTruncate,
    "conversation.item.delete": ItemRef,
    "conversation.item.retrieve": ItemRef,
    "response.create": ResponseCreate,
    "response.cancel": ClientEvent,
}


def first_problem(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    """(param, message) of the first validation error, param dotted as the client wrote it."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal")))
    param = f"{prefix}{param}" if param else prefix.rstrip(".")
    if err["type"] == "missing":
        return param, f"Missing required parameter: '{param}'."
    return param, f"Invalid value for '{param}': {err['msg']}."
