"""Typed settings, layered: embedded defaults < --config FILE < DUPLEX_* environment < CLI flags.

Every layer is validated on its own so an error names where the bad key or value came from.
Environment variables spell a nested key with a double underscore: DUPLEX_SERVER__PORT=9000.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from models.caches import CacheBudgets

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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """auto: bfloat16 on a GPU, float32 on the CPU."""


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
    pin_cpus: bool = False
    """With the engine in its own process: it runs on the last `torch_threads` cores and the
    server on the others, so neither waits for a core the other holds (the engine's stage
    calls then have the CPU ~98% of their wall time on the 2-core machine, ~89% unpinned), but
    the server can no longer use the engine's idle time. Off, the OS places both; ignored where
    there is a core or fewer to split."""
    cuda_graphs: bool = False
    """Replay the fixed-shape steps (Qwen3-Omni's Thinker and Talker decode steps, its code
    predictor's frames) as CUDA graphs captured at start, one per batch bucket; only on a CUDA
    device, ignored on the CPU."""
    kv_memory: float = Field(0.0, ge=0)
    """The paged KV pools' budget: bytes (above 1), or a fraction (1 or less) of the memory
    free once the weights are loaded; 0: 0.8 of it on CUDA, on the CPU 64 sessions at full
    context (at most a quarter of the memory available). Sessions and replies are admitted
    only while their blocks fit in it."""


class CacheSettings(_Section):
    """Byte budgets of the model's cross-session caches; 0 turns a cache off."""

    prefix_bytes: int = Field(CacheBudgets.prefix_bytes, ge=0)
    """Thinker KV of system turns (instructions, tools), shared by sessions that start alike."""
    feature_bytes: int = Field(CacheBudgets.feature_bytes, ge=0)
    """Vision encoder features of images seen before."""


class DuplexSettings(_Section):
    max_lag_ms: int = Field(400, ge=80, le=10_000)
    """A native duplex session further behind its input than this drops its oldest frames and
    resyncs, so latency stays bounded when the engine cannot keep up."""
    default_mode: dict[str, Literal["turns", "duplex"]] = {}
    """Per model (its --model name): how its sessions start. "duplex" runs every new session
    (WebSocket, WebRTC, Twilio) natively full duplex until a client asks for turns."""


class RealtimeSettings(_Section):
    max_message_bytes: int = Field(1 << 20, ge=1024)
    max_input_lead_ms: int = Field(5000, ge=100)
    """Appended audio may run this far ahead of real time; beyond it appends are refused."""
    output_lead_ms: int = Field(100, ge=0, le=2000)
    """Reply audio is sent at most this far ahead of the listener's playback: what a WebSocket
    client still plays after a pause (it owns its playout), and its cushion against the
    server's stalls."""
    max_errors: int = Field(100, ge=1)
    """Errors one connection may cause before it is closed with 1008."""
    mcp_timeout_s: float = Field(30.0, gt=0, le=600)
    """How long an MCP server may take to list its tools or answer a call (the server's own
    MCP client, for `{type: "mcp"}` tools); then the listing or call fails."""


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
    output_lead_ms: int = Field(200, ge=0, le=2000)
    """Reply audio is queued on a call's track at most this far ahead of what it has played: a
    cushion against the server's stalls (a pause holds the track at once, whatever it holds)."""


class TelephonySettings(_Section):
    public_url: str = Field("", pattern=r"^((https?|wss?)://[^/\s]+(/\S*)?)?$")
    """Where Twilio reaches this server (https://HOST[/PREFIX]); empty: the Host it asked on."""
    end_call_digit: str = Field("", pattern=r"^[0-9*#A-D]?$")
    """A DTMF digit that hangs up the call; empty for none."""
    output_lead_ms: int = Field(200, ge=0, le=2000)
    """Reply audio is sent at most this far ahead of the caller's playback."""
    min_interruption_ms: int = Field(400, ge=0, le=10_000)
    """Speech over a reply pauses it; only speech this long cancels it (0: at once)."""
    turn_detection: Literal["semantic_vad", "server_vad"] = "semantic_vad"
    """How a caller's turn ends: semantic_vad, when the end-of-turn model (turns.model) judges
    it complete at a short pause, or after `eagerness`'s longest wait; server_vad, after
    500 ms of silence."""
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"
    """semantic_vad's longest wait for a turn the model does not judge complete: 8, 4, 2 s
    (auto: medium)."""
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
    """0 means no limit. Concurrent sessions count across every node sharing a Redis store,
    on this node alone with the memory store."""

    sessions: int = Field(0, ge=0)
    sessions_per_key: int = Field(0, ge=0)
    messages_per_s: float = Field(0.0, ge=0)
    """Client events per second, all sessions of the node together."""
    messages_per_s_per_key: float = Field(0.0, ge=0)
    message_burst: int = Field(50, ge=1)
    max_session_s: float = Field(0.0, ge=0)
    lease_s: float = Field(10.0, gt=0)
    """With a Redis store: each node renews its sessions' places in the count every
    store.heartbeat_s; a dead node's sessions stop counting this long after its last renewal."""


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
    context_max_bytes: int = Field(8 << 20, ge=0)
    """Cap on one session's saved model context (user audio as FLAC, reply tokens); past it the
    oldest turns are left out of what a resume on another node rebuilds."""
    keep_live_s: float = Field(0.0, ge=0)
    """How long a dropped connection's engine state (the model's context as it is) stays on
    its node for a resume there to take over instead of rebuilding it; 0: released at once."""

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


class TurnSettings(_Section):
    model: str = "smart-turn-v3.2"
    """The end-of-turn model semantic_vad asks at a pause: smart-turn-v3.2 (Smart Turn v3.2,
    BSD 2-Clause; fetched on first use into model.cache_dir from the pipecat-ai 1.14.0 wheel
    on PyPI, its hash checked), the path of a Smart Turn ONNX file, or "" for none (semantic_vad
    then ends a turn after a silence its eagerness sets)."""
    threads: int = Field(1, ge=1)
    """CPU threads for one scoring call."""


class Settings(_Section):
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    caches: CacheSettings = CacheSettings()
    duplex: DuplexSettings = DuplexSettings()
    realtime: RealtimeSettings = RealtimeSettings()
    webrtc: WebRTCSettings = WebRTCSettings()
    telephony: TelephonySettings = TelephonySettings()
    store: StoreSettings = StoreSettings()
    auth: AuthSettings = AuthSettings()
    limits: LimitsSettings = LimitsSettings()
    transcription: TranscriptionSettings = TranscriptionSettings()
    turns: TurnSettings = TurnSettings()

    @model_validator(mode="after")
    def _lease_outlives_renewal(self) -> Settings:
        # Leases exist only where sessions are counted in Redis.
        lease, store, limits = self.limits.lease_s, self.store, self.limits
        leased = store.backend == "redis" and (limits.sessions or limits.sessions_per_key)
        if leased and not store.heartbeat_s < lease <= store.retention_s:
            raise ValueError(
                f"limits.lease_s ({lease:g}) must be longer than store.heartbeat_s "
                f"({store.heartbeat_s:g}), which renews it, and at most store.retention_s "
                f"({store.retention_s:g})")
        return self


class ConfigError(Exception):
    """A bad setting; the message names the key and where it came from."""


SECRETS = frozenset({("auth", "api_keys"), ("telephony", "auth_token"), ("store", "redis_url"),
                     ("webrtc", "ice_servers")})
"""Settings never echoed in errors, and the only ones a `DUPLEX_..._FILE` variable may supply
(a Redis URL may hold a password, ICE servers TURN credentials)."""


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(err: Any, names: Mapping[tuple[str, ...], str]) -> str:
    loc = tuple(str(part) for part in err["loc"])
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        problem = f"unknown key '{key}'"
    else:
        problem = f"'{key}': {err['msg']}"
        value = err.get("input")
        # A section-wide check sees the whole section, secrets included: show leaf values only.
        if not isinstance(value, (dict, list)) and loc[:2] not in SECRETS:
            problem += f" (got {value!r})"
    for n in range(len(loc), 0, -1):
        if loc[:n] in names:
            return f"{names[loc[:n]]}: {problem}"
    # A check of a whole section: name every variable that set something in it.
    within = [var for path, var in names.items() if path[:len(loc)] == loc]
    return f"{', '.join(within)}: {problem}" if within else problem


def _validate(data: dict[str, Any], source: str,
              names: Mapping[tuple[str, ...], str] | None = None) -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(err, names or {}) for err in exc.errors()]
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


# Conveniences that deployments expect by these names.
ENV_ALIASES = {"DUPLEX_REDIS_URL": "DUPLEX_STORE__REDIS_URL"}
FILE_SUFFIX = "_FILE"


def _field(path: list[str]) -> Any:
    """The annotation of the setting at `path`; None when there is no such setting (validation
    then reports the unknown key)."""
    model: Any = Settings
    annotation = None
    for part in path:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        info = model.model_fields.get(part)
        if info is None:
            return None
        annotation = model = info.annotation
    return annotation


def _structured(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    origin = get_origin(annotation)
    if origin in (list, dict):
        return True
    return any(_structured(arm) for arm in get_args(annotation)) if origin is not None else False


def _parse_env(var: str, value: str, annotation: Any, from_file: bool) -> Any:
    """A DUPLEX_* value as its setting expects it: plain values stay strings (pydantic converts
    them); lists and tables are JSON, as pydantic-settings reads them; a list of strings may
    also be written bare, separated by commas (and, in a file, by lines)."""
    if not _structured(annotation):
        return value
    text = value.strip()
    if text.startswith(("[", "{")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{var}: not valid JSON: {exc.msg} (line {exc.lineno} column "
                              f"{exc.colno})") from None
    if annotation == list[str]:
        parts = re.split(r"[,\n]" if from_file else ",", text)
        return [part.strip() for part in parts if part.strip()]
    raise ConfigError(f"{var}: expected JSON, a list [...] or a table {{...}}")


def _read_secret(var: str, filename: str) -> str:
    try:
        text = Path(filename).read_text()
    except OSError as exc:
        raise ConfigError(f"{var}: cannot read {filename}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{var}: {filename} is not UTF-8 text") from None
    # A secret file that is empty would turn authentication off without a word.
    if not text.strip():
        raise ConfigError(f"{var}: {filename} is empty")
    return text.strip()


def env_settings(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The settings DUPLEX_* variables give, and which variable gave each (for errors).
    `DUPLEX_X_FILE=PATH` reads secret X from a file (the Docker and Kubernetes convention)."""
    out: dict[str, Any] = {}
    names: dict[tuple[str, ...], str] = {}
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        name, from_file = var, False
        if var.endswith(FILE_SUFFIX):
            name, from_file = var[: -len(FILE_SUFFIX)], True
        name = ENV_ALIASES.get(name, name)
        path = name[len(ENV_PREFIX):].lower().split("__")
        if from_file and tuple(path) not in SECRETS:
            readable = ", ".join(ENV_PREFIX + "__".join(secret).upper() + FILE_SUFFIX
                                 for secret in sorted(SECRETS))
            raise ConfigError(f"{var}: only secrets can be read from a file ({readable})")
        if tuple(path) in names:
            raise ConfigError(f"{names[tuple(path)]} and {var} both set "
                              f"'{'.'.join(path)}'; set only one")
        raw = _read_secret(var, environ[var]) if from_file else environ[var]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{var}: '{part}' is not a section")
        node[path[-1]] = _parse_env(var, raw, _field(path), from_file)
        names[tuple(path)] = var
    return out, names


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
    env, names = env_settings(os.environ if environ is None else environ)
    if env:
        data = _merge(data, env)
        _validate(data, "environment", names)
    if cli:
        data = _merge(data, cli)
    return _validate(data, "command line")
