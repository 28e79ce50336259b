"""A Realtime session's settings: one typed record, read from the GA or the beta spelling and
written back in the client's own, whole (as OpenAI echoes the effective session).

An update is validated whole before anything changes: `updated_ga` / `updated_beta` return a
new `SessionSettings` or raise `ConfigError`, and the old settings stay as they were.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from duplex.media.rates import REALTIME_RATE as RATE
from duplex.transport.realtime import schema
from models.reply import ReplySpec, Truncation

BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
_FLAT_FORMATS = {v: k for k, v in BETA_FORMATS.items()}
DEFAULT_VOICE = "alloy"
DEFAULT_MIN_INTERRUPTION_MS = 400
"""Speech over a reply shorter than this (a cough, a click, a "mhm") pauses the reply and lets
it go on; longer speech cancels it."""
RESUME_GAP_MS = 200
"""Quiet after a paused reply's speech that ends it as a false interruption."""


class ConfigError(ValueError):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True)
class SessionSettings:
    type: str = "realtime"
    """realtime, or transcription: the user's turns are transcribed and never answered."""
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: schema.TurnDetection | None = field(
        default_factory=lambda: schema.TurnDetection(type="server_vad"))
    transcription: dict[str, Any] | None = None
    noise_reduction: dict[str, Any] | None = None
    voice: str = DEFAULT_VOICE
    speed: float = 1.0
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    temperature: float | None = None
    """None: the model's own sampling (the tiny checkpoints': greedy); 0 is greedy."""
    max_output_tokens: int | str = "inf"
    truncation: str | dict[str, Any] = "auto"
    duplex_events: bool = False
    """Send duplex's own events (`duplex.response.timings`); off, so strict clients that check
    every event against OpenAI's list never meet one."""
    mcp_headers: dict[str, dict[str, str]] = field(default_factory=dict, repr=False,
                                                   compare=False)
    """What each MCP server (by label) is sent with every request (`headers`, and
    `authorization` as a bearer token): secrets, kept out of `tools`, never echoed, logged or
    put in the registry; they go to that server alone."""

    def record(self) -> dict[str, Any]:
        """Plain JSON for the session registry (a resume restores it with `from_record`);
        without the MCP servers' headers, which a resumed session is sent again."""
        out = asdict(self)
        del out["mcp_headers"]
        out["turn_detection"] = _dump(self.turn_detection)
        return out

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> SessionSettings:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if known.get("turn_detection") is not None:
            known["turn_detection"] = schema.TurnDetection.model_validate(known["turn_detection"])
        for name in ("output_modalities", "tools"):
            if name in known:
                known[name] = tuple(known[name])
        return cls(**known)


def _dump(model: BaseModel | None) -> dict[str, Any] | None:
    return None if model is None else model.model_dump(exclude_none=True)


def _validate(model: type[BaseModel], data: Any, prefix: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        param, message = schema.first_problem(exc, prefix)
        if tool := _naming_tool(data, param, prefix):
            message = f"{message.removesuffix('.')}{tool}."
        raise ConfigError("invalid_value", message, param) from None


def _naming_tool(data: Any, param: str, prefix: str) -> str:
    """Which tool a problem in `tools` is in, by its name or server label."""
    found = re.match(re.escape(prefix) + r"tools\.(\d+)", param)
    tools = data.get("tools") if isinstance(data, dict) else None
    if found is None or not isinstance(tools, list) or int(found[1]) >= len(tools):
        return ""
    return _tool_label(tools[int(found[1])])


def _tool_label(tool: Any) -> str:
    if not isinstance(tool, dict):
        return ""
    if tool.get("type") == "mcp" and isinstance(tool.get("server_label"), str):
        return f" (the MCP tool '{tool['server_label']}')"
    return f" (the tool '{tool['name']}')" if isinstance(tool.get("name"), str) else ""


def _prompt(cfg: schema.SessionConfig | schema.BetaSessionConfig
            | schema.ResponseParams | schema.BetaResponseParams,
            prefix: str) -> dict[str, Any]:
    """Instructions, tools and tool choice: named alike in sessions and responses."""
    changes: dict[str, Any] = {}
    if cfg.instructions is not None:
        changes["instructions"] = cfg.instructions
    if cfg.tools is not None:
        tools, headers = _tools(cfg.tools, prefix)
        changes["tools"] = tools
        if prefix == "session.":
            changes["mcp_headers"] = headers
    if cfg.tool_choice is not None:
        choice = cfg.tool_choice
        changes["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump(
            exclude_none=True)
    return changes


def _tools(tools: list[schema.FunctionTool | schema.McpTool],
           prefix: str) -> tuple[tuple[dict[str, Any], ...], dict[str, dict[str, str]]]:
    """The tools as the session echoes them, and the MCP servers' headers kept apart; the
    first bad MCP tool refuses them all (ConfigError naming it)."""
    out, headers = [], {}
    for i, tool in enumerate(tools):
        if isinstance(tool, schema.FunctionTool):
            out.append(tool.model_dump(exclude_none=True))
            continue
        param, label = f"{prefix}tools.{i}", tool.server_label
        if prefix != "session.":
            raise ConfigError("invalid_value",
                              f"Invalid value for '{param}.type': the MCP tool '{label}' can "
                              "only be set on the session (session.update); response.tools "
                              "takes function tools.", f"{param}.type")
        if label in headers:
            raise ConfigError("invalid_value",
                              f"Invalid value for '{param}.server_label': two MCP tools are "
                              f"labelled '{label}'.", f"{param}.server_label")
        if tool.server_url is None:
            why = ("connectors are OpenAI's own services; give the MCP server's server_url"
                   if tool.connector_id is not None else "it is required")
            raise ConfigError("missing_required_parameter" if tool.connector_id is None
                              else "invalid_value",
                              f"Missing required parameter: '{param}.server_url' of the MCP "
                              f"tool '{label}' ({why}).", f"{param}.server_url")
        url = urlsplit(tool.server_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError("invalid_value",
                              f"Invalid value for '{param}.server_url': the MCP tool '{label}' "
                              "needs an http:// or https:// URL.", f"{param}.server_url")
        sent = dict(tool.headers or {})
        if tool.authorization is not None:
            sent.setdefault("Authorization", f"Bearer {tool.authorization}")
        headers[label] = sent
        out.append(tool.model_dump(exclude_none=True, exclude={"headers", "authorization"}))
    return tuple(out), headers


def _common(cfg: schema.SessionConfig | schema.BetaSessionConfig) -> dict[str, Any]:
    """The fields both spellings name alike."""
    changes = _prompt(cfg, "session.")
    if cfg.temperature is not None:
        changes["temperature"] = cfg.temperature
    if cfg.truncation is not None:
        trunc = cfg.truncation
        changes["truncation"] = trunc if isinstance(trunc, str) else trunc.model_dump()
    if cfg.duplex_events is not None:
        changes["duplex_events"] = cfg.duplex_events
    return changes


def _check_tools(settings: SessionSettings | ResponseSettings, prefix: str) -> None:
    choice = settings.tool_choice
    if not isinstance(choice, dict):
        return
    if choice["type"] == "mcp":
        servers = {t["server_label"]: t for t in settings.tools if t.get("type") == "mcp"}
        label = choice["server_label"]
        if label not in servers:
            raise ConfigError(
                "invalid_value",
                f"Invalid value for '{prefix}tool_choice.server_label': no MCP tool labelled "
                f"'{label}' (MCP tools: {', '.join(servers) or 'none'}).",
                f"{prefix}tool_choice.server_label")
        allowed = servers[label].get("allowed_tools")
        if isinstance(allowed, dict):
            allowed = allowed.get("tool_names")
        if "name" in choice and allowed is not None and choice["name"] not in allowed:
            raise ConfigError(
                "invalid_value",
                f"Invalid value for '{prefix}tool_choice.name': the MCP tool '{label}' does not "
                f"allow '{choice['name']}' (allowed_tools: {', '.join(allowed)}).",
                f"{prefix}tool_choice.name")
        return
    names = [t["name"] for t in settings.tools if t.get("type") != "mcp"]
    if choice["name"] not in names:
        raise ConfigError(
            "invalid_value",
            f"Invalid value for '{prefix}tool_choice.name': no tool named '{choice['name']}' "
            f"(tools: {', '.join(names) or 'none'}).", f"{prefix}tool_choice.name")


def _ga_modalities(values: list[str], param: str) -> tuple[str, ...]:
    """GA asks for audio (with its transcript) or text, never both; beta's ["audio", "text"]
    is its spelling of the first."""
    if {"audio", "text"} <= set(values):
        raise ConfigError("invalid_value",
                          f"Invalid value for '{param}': it is not possible to request both "
                          "text and audio at the same time; use ['audio'] (audio with its "
                          "transcript) or ['text'].", param)
    return tuple(values)


def updated_ga(current: SessionSettings, data: dict[str, Any]) -> SessionSettings:
    for flat in ("input_audio_format", "output_audio_format", "modalities"):
        if flat in data:
            raise ConfigError("unknown_parameter",
                              f"Unknown parameter: 'session.{flat}'. Use session.audio (GA); "
                              "beta spellings need the OpenAI-Beta: realtime=v1 header.",
                              f"session.{flat}")
    cfg: schema.SessionConfig = _validate(schema.SessionConfig, data, "session.")
    changes = _common(cfg)
    if cfg.type is not None:
        changes["type"] = cfg.type
    if cfg.output_modalities is not None:
        changes["output_modalities"] = _ga_modalities(cfg.output_modalities,
                                                      "session.output_modalities")
    if cfg.max_output_tokens is not None:
        changes["max_output_tokens"] = cfg.max_output_tokens
    audio_in = cfg.audio.input if cfg.audio else None
    audio_out = cfg.audio.output if cfg.audio else None
    if audio_in is not None:
        if audio_in.format is not None:
            changes["input_format"] = audio_in.format.type
        if "turn_detection" in audio_in.model_fields_set:
            changes["turn_detection"] = audio_in.turn_detection
        if "transcription" in audio_in.model_fields_set:
            changes["transcription"] = _dump(audio_in.transcription)
        if "noise_reduction" in audio_in.model_fields_set:
            changes["noise_reduction"] = _dump(audio_in.noise_reduction)
    if audio_out is not None:
        if audio_out.format is not None:
            changes["output_format"] = audio_out.format.type
        if audio_out.voice is not None:
            changes["voice"] = audio_out.voice
        if audio_out.speed is not None:
            changes["speed"] = audio_out.speed
    new = replace(current, **changes)
    _check_tools(new, "session.")
    return new


def updated_beta(current: SessionSettings, data: dict[str, Any]) -> SessionSettings:
    cfg: schema.BetaSessionConfig = _validate(schema.BetaSessionConfig, data, "session.")
    changes = _common(cfg)
    if cfg.modalities is not None:
        changes["output_modalities"] = tuple(cfg.modalities)
    if cfg.max_response_output_tokens is not None:
        changes["max_output_tokens"] = cfg.max_response_output_tokens
    if cfg.input_audio_format is not None:
        changes["input_format"] = BETA_FORMATS[cfg.input_audio_format]
    if cfg.output_audio_format is not None:
        changes["output_format"] = BETA_FORMATS[cfg.output_audio_format]
    if "turn_detection" in cfg.model_fields_set:
        changes["turn_detection"] = cfg.turn_detection
    if "input_audio_transcription" in cfg.model_fields_set:
        changes["transcription"] = _dump(cfg.input_audio_transcription)
    if "input_audio_noise_reduction" in cfg.model_fields_set:
        changes["noise_reduction"] = _dump(cfg.input_audio_noise_reduction)
    if cfg.voice is not None:
        changes["voice"] = cfg.voice
    if cfg.speed is not None:
        changes["speed"] = cfg.speed
    new = replace(current, **changes)
    _check_tools(new, "session.")
    return new


def min_interruption_ms(td: schema.TurnDetection | None) -> int:
    """0 (cancel at once) without turn detection: a client's own turns are not judged."""
    if td is None:
        return 0
    return DEFAULT_MIN_INTERRUPTION_MS if td.min_interruption_ms is None else td.min_interruption_ms


def noise_reduction_type(s: SessionSettings) -> str | None:
    return None if s.noise_reduction is None else s.noise_reduction.get("type")


def format_wire(fmt: str) -> dict[str, Any]:
    return {"type": fmt, "rate": RATE} if fmt == "audio/pcm" else {"type": fmt}


def flat_format(fmt: str) -> str:
    return _FLAT_FORMATS[fmt]


def turn_detection_wire(td: schema.TurnDetection | None) -> dict[str, Any] | None:
    if td is None:
        return None
    if td.type == "semantic_vad":
        wire = {"type": td.type, "eagerness": td.eagerness or "auto",
                "create_response": td.create_response,
                "interrupt_response": td.interrupt_response}
        if td.min_interruption_ms is not None:
            wire["min_interruption_ms"] = td.min_interruption_ms
        return wire
    if td.type == "duplex":
        # The model decides when to reply and nothing interrupts it: those settings mean nothing.
        return td.model_dump(include={"type", "threshold", "prefix_padding_ms",
                                      "silence_duration_ms"})
    return td.model_dump(exclude_none=True, exclude={"eagerness"})


def ga_session(s: SessionSettings, session_id: str, model: str) -> dict[str, Any]:
    if s.type == "transcription":
        return transcription_session(s, session_id)
    out = {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": list(s.output_modalities),
        "instructions": s.instructions,
        "tools": list(s.tools),
        "tool_choice": s.tool_choice,
        "max_output_tokens": s.max_output_tokens,
        "truncation": s.truncation,
        "tracing": None,
        "prompt": None,
        "audio": {
            "input": {
                "format": format_wire(s.input_format),
                "transcription": s.transcription,
                "noise_reduction": s.noise_reduction,
                "turn_detection": turn_detection_wire(s.turn_detection),
            },
            "output": {"format": format_wire(s.output_format), "voice": s.voice,
                       "speed": s.speed},
        },
    }
    if s.duplex_events:
        out["duplex_events"] = True
    return out


def transcription_session(s: SessionSettings, session_id: str) -> dict[str, Any]:
    """A transcription session as the GA API writes one."""
    return {
        "type": "transcription",
        "object": "realtime.transcription_session",
        "id": session_id,
        "audio": {"input": {
            "format": format_wire(s.input_format),
            "transcription": s.transcription,
            "noise_reduction": s.noise_reduction,
            "turn_detection": turn_detection_wire(s.turn_detection),
        }},
        "include": None,
    }


def beta_session(s: SessionSettings, session_id: str, model: str) -> dict[str, Any]:
    out = {
        "id": session_id,
        "object": "realtime.session",
        "model": model,
        "modalities": list(s.output_modalities),
        "instructions": s.instructions,
        "voice": s.voice,
        "speed": s.speed,
        "input_audio_format": flat_format(s.input_format),
        "output_audio_format": flat_format(s.output_format),
        "input_audio_transcription": s.transcription,
        "input_audio_noise_reduction": s.noise_reduction,
        "turn_detection": turn_detection_wire(s.turn_detection),
        "tools": list(s.tools),
        "tool_choice": s.tool_choice,
        "temperature": s.temperature,
        "max_response_output_tokens": s.max_output_tokens,
        "truncation": s.truncation,
        "tracing": None,
    }
    if s.duplex_events:
        out["duplex_events"] = True
    return out


@dataclass(frozen=True)
class ResponseSettings:
    """What one reply runs with: the session's settings, overridden by `response.create`."""

    output_modalities: tuple[str, ...]
    output_format: str
    voice: str
    instructions: str
    tools: tuple[dict[str, Any], ...]
    tool_choice: str | dict[str, Any]
    temperature: float | None
    max_output_tokens: int | str
    conversation: str = "auto"
    """"none": an out-of-band reply whose output does not join the conversation."""
    metadata: dict[str, str] | None = None
    truncation: str | dict[str, Any] = "auto"
    """The session's: what the Thinker does when its context fills."""
    mcp_tools: dict[str, Any] = field(default_factory=dict)
    """The MCP tools among `tools` once resolved for the model (`mcp.McpTools.resolve`), by
    the name the model calls them."""
    follow_up: int = 0
    """Replies the server asked for in a row after MCP calls, this one included (0: asked
    for by the client or its turn)."""
    speed: float = 1.0
    """The session's audio.output.speed, as the reply started (OpenAI: it changes between
    replies, never during one)."""

    @property
    def audio(self) -> bool:
        return "audio" in self.output_modalities

    def spec(self) -> ReplySpec:
        """What the model is asked for."""
        return ReplySpec(
            audio=self.audio,
            max_output_tokens=None if self.max_output_tokens == "inf" else self.max_output_tokens,
            instructions=self.instructions, voice=self.voice, temperature=self.temperature,
            tools=self.tools, tool_choice=self.tool_choice,
            truncation=Truncation.of(self.truncation),
        )


def response_settings(s: SessionSettings, params: dict[str, Any] | None,
                      beta: bool) -> ResponseSettings:
    """Resolve a reply's settings; raises ConfigError naming the bad `response.` field."""
    base = ResponseSettings(
        output_modalities=s.output_modalities, output_format=s.output_format, voice=s.voice,
        instructions=s.instructions, tools=s.tools, tool_choice=s.tool_choice,
        temperature=s.temperature, max_output_tokens=s.max_output_tokens,
        truncation=s.truncation, speed=s.speed,
    )
    if not params:
        return base
    model = schema.BetaResponseParams if beta else schema.ResponseParams
    p = _validate(model, params, "response.")
    changes = _prompt(p, "response.")
    if p.conversation is not None:
        changes["conversation"] = p.conversation
    if p.metadata is not None:
        changes["metadata"] = dict(p.metadata)
    if beta:
        if p.modalities is not None:
            changes["output_modalities"] = tuple(p.modalities)
        if p.max_response_output_tokens is not None:
            changes["max_output_tokens"] = p.max_response_output_tokens
        if p.voice is not None:
            changes["voice"] = p.voice
        if p.output_audio_format is not None:
            changes["output_format"] = BETA_FORMATS[p.output_audio_format]
        if p.temperature is not None:
            changes["temperature"] = p.temperature
    else:
        if p.output_modalities is not None:
            changes["output_modalities"] = _ga_modalities(p.output_modalities,
                                                          "response.output_modalities")
        if p.max_output_tokens is not None:
            changes["max_output_tokens"] = p.max_output_tokens
        out = p.audio.output if p.audio else None
        if out is not None and out.voice is not None:
            changes["voice"] = out.voice
        if out is not None and out.format is not None:
            changes["output_format"] = out.format.type
    resolved = replace(base, **changes)
    _check_tools(resolved, "response.")
    return resolved


@dataclass(frozen=True)
class Voices:
    """The voices a session may ask for: the model's own speakers, and OpenAI's names (which
    clients send by default), which select the model's default speaker."""

    model: tuple[str, ...] = ()
    default: str | None = None

    def check(self, voice: str, param: str) -> None:
        if voice not in self.model and voice not in OPENAI_VOICES:
            names = ", ".join(self.model + OPENAI_VOICES)
            raise ConfigError("invalid_value",
                                f"Invalid value for '{param}': unknown voice '{voice}'; "
                                f"available voices: {names}.", param)

    def for_model(self, voice: str) -> str | None:
        """The speaker the model is asked for; None for its default."""
        return voice if voice in self.model else None


OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse",
                 "marin", "cedar")
