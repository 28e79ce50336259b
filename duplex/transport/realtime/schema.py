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
    type: Literal["server_vad", "semantic_vad", "duplex"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    prefix_padding_ms: Annotated[int, Field(ge=0, le=10_000)] = 300
    silence_duration_ms: Annotated[int, Field(ge=0, le=10_000)] = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: Annotated[int, Field(ge=5_000, le=30_000)] | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    min_interruption_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    """duplex extension: speech over a reply pauses it, and cancels it only once it has lasted
    this long; None: the server's default (DEFAULT_MIN_INTERRUPTION_MS), 0: cancel at once."""


class Transcription(_Loose):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class NoiseReduction(_Loose):
    type: Literal["near_field", "far_field"]


class AudioInput(_Loose):
    format: AudioFormat | None = None
    turn_detection: TurnDetection | None = None
    transcription: Transcription | None = None
    noise_reduction: NoiseReduction | None = None


class AudioOutput(_Loose):
    format: AudioFormat | None = None
    voice: str | None = None
    speed: Annotated[float, Field(ge=0.25, le=1.5)] | None = None


class Audio(_Loose):
    input: AudioInput | None = None
    output: AudioOutput | None = None


class FunctionTool(_Loose):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class McpToolFilter(_Loose):
    tool_names: list[str] | None = None
    read_only: bool | None = None


class McpApprovalFilter(_Loose):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpTool(_Loose):
    """A remote MCP server whose tools the server lists and calls for the model."""

    type: Literal["mcp"]
    server_label: Annotated[str, Field(min_length=1, max_length=64,
                                       pattern=r"^[A-Za-z][A-Za-z0-9_-]*$")]
    server_url: str | None = None
    connector_id: str | None = None
    allowed_tools: list[str] | McpToolFilter | None = None
    require_approval: Literal["always", "never"] | McpApprovalFilter | None = None
    headers: dict[str, str] | None = None
    authorization: str | None = None
    server_description: str | None = None


Tool = Annotated[FunctionTool | McpTool, Field(discriminator="type")]


class ToolChoiceFunction(_Loose):
    type: Literal["function"]
    name: str


class ToolChoiceMcp(_Loose):
    type: Literal["mcp"]
    server_label: str
    name: str | None = None


class RetentionRatio(_Loose):
    type: Literal["retention_ratio"]
    retention_ratio: Annotated[float, Field(ge=0.0, le=1.0)]


ToolChoice = Literal["auto", "none", "required"] | Annotated[
    ToolChoiceFunction | ToolChoiceMcp, Field(discriminator="type")]
MaxTokens = Annotated[int, Field(ge=1, le=4096)] | Literal["inf"]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class _SessionFields(_Loose):
    """Fields the GA and beta session objects spell alike."""

    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    truncation: Literal["auto", "disabled"] | RetentionRatio | None = None
    duplex_events: bool | None = None
    """duplex extension: send duplex's own events (per-stage timings)."""


class SessionConfig(_SessionFields):
    type: Literal["realtime", "transcription"] | None = None
    """transcription: turns are transcribed, never answered."""
    output_modalities: list[Literal["audio", "text"]] | None = None
    max_output_tokens: MaxTokens | None = None
    audio: Audio | None = None


class BetaSessionConfig(_SessionFields):
    modalities: list[Literal["audio", "text"]] | None = None
    max_response_output_tokens: MaxTokens | None = None
    input_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | None = None
    output_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | None = None
    turn_detection: TurnDetection | None = None
    input_audio_transcription: Transcription | None = None
    input_audio_noise_reduction: NoiseReduction | None = None
    voice: str | None = None
    speed: Annotated[float, Field(ge=0.25, le=1.5)] | None = None


class ContentPart(_Loose):
    type: Literal["input_text", "input_audio", "input_image", "text", "output_text", "output_audio",
                  "audio"]
    text: str | None = None
    audio: str | None = None
    image_url: str | None = None
    transcript: str | None = None


class MessageItem(_Loose):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str = ""


class FunctionCallOutputItem(_Loose):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    output: str


class McpApprovalResponseItem(_Loose):
    type: Literal["mcp_approval_response"]
    id: str | None = None
    approval_request_id: Annotated[str, Field(min_length=1)]
    approve: bool
    reason: str | None = None


ITEM_TYPES: dict[str, type[_Loose]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "mcp_approval_response": McpApprovalResponseItem,
}
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | McpApprovalResponseItem


class ResponseAudioOutput(_Loose):
    format: AudioFormat | None = None
    voice: str | None = None


class ResponseAudio(_Loose):
    output: ResponseAudioOutput | None = None


class _ResponseFields(_Loose):
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    conversation: Literal["auto", "none"] | None = None
    metadata: Metadata | None = None
    input: list[dict[str, Any]] | None = None


class ResponseParams(_ResponseFields):
    """`response.create`'s `response` (GA)."""

    output_modalities: list[Literal["audio", "text"]] | None = None
    max_output_tokens: MaxTokens | None = None
    audio: ResponseAudio | None = None


class BetaResponseParams(_ResponseFields):
    modalities: list[Literal["audio", "text"]] | None = None
    max_response_output_tokens: MaxTokens | None = None
    voice: str | None = None
    output_audio_format: Literal["pcm16", "g711_ulaw", "g711_alaw"] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None


class ClientEvent(_Loose):
    type: str
    event_id: str | None = None


class SessionUpdate(ClientEvent):
    session: dict[str, Any]


class Append(ClientEvent):
    audio: str


class ItemCreate(ClientEvent):
    item: dict[str, Any]
    """Validated by its own `type` against ITEM_TYPES, so errors name the item's fields."""
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
    param = ".".join(str(p) for p in err["loc"] if not _is_union_branch(p))
    param = f"{prefix}{param}" if param else prefix.rstrip(".")
    if err["type"] == "missing":
        return param, f"Missing required parameter: '{param}'."
    return param, f"Invalid value for '{param}': {err['msg']}."


def _is_union_branch(part: object) -> bool:
    """pydantic names the union member it tried in the error's location (a discriminated
    union, by its tag); clients wrote none."""
    if not isinstance(part, str):
        return False
    return part.startswith(("function-", "literal", "constrained-")) or part in _MODEL_NAMES \
        or part in _TAGS or "[" in part


_TAGS = {"function", "mcp"}


def _subclasses(cls: type) -> set[type]:
    return {cls, *(c for sub in cls.__subclasses__() for c in _subclasses(sub))}


_MODEL_NAMES = {cls.__name__ for cls in _subclasses(_Loose)}
