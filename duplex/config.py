"""Typed settings, layered: embedded defaults < --config FILE < DUPLEX_* environment < CLI flags.

Every layer is validated on its own so an error names where the bad key or value came from.
Environment variables spell a nested key with a double underscore: DUPLEX_SERVER__PORT=9000.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "DUPLEX_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    """json: one object a line, with session_id and epoch where a session logged it."""
    shutdown_timeout_s: float = Field(5.0, gt=0)


class ModelSettings(_Section):
    name: str = "tiny-omni"
    """echo, tiny-omni, tiny-moshi, or the path of a local checkpoint directory."""
    cache_dir: str = ".models"
    """Where the tiny random-weight checkpoints are built and found."""
    device: Literal["auto", "cpu", "cuda"] = "auto"


class EngineSettings(_Section):
    max_sessions: int = Field(64, ge=1)
    max_load: float = Field(0.85, gt=0, le=1)
    """Busy fraction of the engine loop past which new sessions are refused."""
    max_batch: int = Field(64, ge=1)
    audio_lead_s: float = Field(1.0, gt=0)
    """Reply audio generated ahead of real time before a session's Talker waits."""
    torch_threads: int = Field(0, ge=0)
    """CPU threads for model math; 0 leaves one core to the event loop (at least 1 thread)."""
    process: bool = True
    """Run the model and engine in a child process (its own interpreter lock); false keeps
    them on a thread of the server process."""


class RealtimeSettings(_Section):
    max_message_bytes: int = Field(1 << 20, ge=1024)
    max_input_lead_ms: int = Field(5000, ge=100)
    """Appended audio may run this far ahead of real time; beyond it appends are refused."""
    output_lead_ms: int = Field(200, ge=0, le=2000)
    """Reply audio is sent at most this far ahead of the listener's playback."""
    max_errors: int = Field(100, ge=1)
    """Errors one connection may cause before it is closed with 1008."""


class IceServer(_Section):
    urls: str | list[str]
    username: str | None = None
    credential: str | None = None


class WebRTCSettings(_Section):
    host_addresses: list[str] = ["127.0.0.1"]
    """Extra host candidates; aioice skips loopback, so a loopback-only host needs this."""
    ice_servers: list[IceServer] = []
    """STUN/TURN servers for real deployments, e.g. {urls = "turn:turn.example:3478", ...}."""
    video_fps: float = Field(2.0, gt=0, le=30)
    """Camera frames per second sampled (by timestamp) into the vision encoder."""


class TelephonySettings(_Section):
    public_url: str = Field("", pattern=r"^((https?|wss?)://[^/\s]+(/\S*)?)?$")
    """Where Twilio reaches this server (https://HOST[/PREFIX]); empty: the Host it asked on."""
    end_call_digit: str = Field("", pattern=r"^[0-9*#A-D]?$")
    """A DTMF digit that hangs up the call; empty for none."""
    output_lead_ms: int = Field(200, ge=0, le=2000)
    """Reply audio is sent at most this far ahead of the caller's playback."""
    min_interruption_ms: int = Field(400, ge=0, le=10_000)
    """Speech over a reply pauses it; only speech this long cancels it (0: at once)."""
    noise_reduction: Literal["", "near_field", "far_field"] = ""
    """The echo guard's strength for calls (as a Realtime session's
    audio.input.noise_reduction); empty: the guard alone."""
    auth_token: str = ""
    """The Twilio account's auth token: /telephony requests must carry a valid
    X-Twilio-Signature (or an API key). Empty: not checked."""


class AuthSettings(_Section):
    api_keys: list[str] = []
    """Keys accepted on every session entry point; empty: no authentication."""
    ephemeral_key_ttl_s: int = Field(600, ge=10, le=7200)
    """Lifetime of an ephemeral key when the request names none."""


class LimitsSettings(_Section):
    """Counted per node; 0 means no limit."""

    sessions: int = Field(0, ge=0)
    sessions_per_key: int = Field(0, ge=0)
    messages_per_s: float = Field(0.0, ge=0)
    """Client events per second, all sessions of the node together."""
    messages_per_s_per_key: float = Field(0.0, ge=0)
    message_burst: int = Field(50, ge=1)
    max_session_s: float = Field(0.0, ge=0)


class StoreSettings(_Section):
    backend: Literal["memory", "redis"] = "memory"
    """memory: this process only. redis: shared by every node (a redis_url selects it)."""
    redis_url: str = ""
    node_id: str = ""
    """This node's name in the registry; empty: hostname and process id."""
    retention_s: float = Field(120.0, gt=0)
    """A session stays resumable this long after its last activity."""
    heartbeat_s: float = Field(2.0, gt=0)
    """How often a live session is saved; a node that lost it finds out within this time."""

    @model_validator(mode="after")
    def _url_selects_redis(self) -> StoreSettings:
        if self.redis_url and self.backend == "memory":
            object.__setattr__(self, "backend", "redis")
        if self.backend == "redis" and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("store.redis_url must be redis://HOST:PORT/DB when backend is redis")
        return self


class TranscriptionSettings(_Section):
    model: str = "whisper-tiny.en"
    """The recogniser sessions get when they ask for OpenAI's names (whisper-1,
    gpt-4o-transcribe, gpt-4o-mini-transcribe): the embedded one, or a local checkpoint PATH."""
    max_queue: int = Field(64, ge=1)
    """Utterances waiting to be recognised, all sessions together; past it one fails at once."""


class Settings(_Section):
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    realtime: RealtimeSettings = RealtimeSettings()
    webrtc: WebRTCSettings = WebRTCSettings()
    telephony: TelephonySettings = TelephonySettings()
    store: StoreSettings = StoreSettings()
    auth: AuthSettings = AuthSettings()
    limits: LimitsSettings = LimitsSettings()
    transcription: TranscriptionSettings = TranscriptionSettings()


class ConfigError(Exception):
    """A bad setting; the message names the key and where it came from."""


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _validate(data: dict[str, Any], source: str) -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            key = ".".join(str(part) for part in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown key '{key}'")
            else:
                problems.append(f"'{key}': {err['msg']} (got {err.get('input')!r})")
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


# Conveniences that deployments expect by these names.
ENV_ALIASES = {"DUPLEX_REDIS_URL": "DUPLEX_STORE__REDIS_URL"}


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        name = ENV_ALIASES.get(name, name)
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    cli: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    data = Settings().model_dump()
    if config_file is not None:
        path = Path(config_file)
        try:
            file_data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        data = _merge(data, file_data)
        _validate(data, str(path))
    env = env_overrides(os.environ if environ is None else environ)
    if env:
        data = _merge(data, env)
        _validate(data, f"environment ({ENV_PREFIX}*)")
    if cli:
        data = _merge(data, cli)
    return _validate(data, "command line")
