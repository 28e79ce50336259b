"""What passes between an engine's callers and its core, as typed messages.

Requests go to the core in the order callers make them; outputs come back: the per-session
events the scheduler produces (AudioOut, ResponseFinished, ResponseTimings, SessionFailed; a
step's events together in one StepEvents), a
Report of what the core holds, and Replies to barriers and queries. The in-process engine and
the engine process carry exactly these messages; only the carrier differs (a queue, or a pipe).
Modelled on vLLM v1's EngineCoreRequest / EngineCoreOutputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.engine.lockstep import DuplexDropped, DuplexOut, TickCost
from duplex.engine.scheduler import (
    AudioOut,
    Drop,
    ReplyTokens,
    ResponseFinished,
    ResponseTimings,
    SessionFailed,
    TextOut,
    ToolCallOut,
)
from models.base import KVStats, Mark, ReplyTurn, Rewind, TextTurn
from models.caches import CacheStats
from models.reply import ReplySpec

# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenSession:
    session_id: str


@dataclass(frozen=True, slots=True)
class PushAudio:
    session_id: str
    pcm: np.ndarray
    """One encoder chunk at the model's input rate (the last of a turn may be short)."""


@dataclass(frozen=True, slots=True)
class PushFrame:
    session_id: str
    frame: np.ndarray
    """RGB uint8 (H, W, 3), already sampled."""


@dataclass(frozen=True, slots=True)
class PushText:
    session_id: str
    turn: TextTurn | ReplyTurn | Mark | Rewind
    """Taken into the context in order with the audio and frames pushed before it."""


@dataclass(frozen=True, slots=True)
class Commit:
    session_id: str
    epoch: int
    at: float
    """When the reply was asked for (time.monotonic), for its timings."""
    spec: ReplySpec


@dataclass(frozen=True, slots=True)
class ClearInput:
    session_id: str


@dataclass(frozen=True, slots=True)
class CancelReply:
    session_id: str
    new_epoch: int


@dataclass(frozen=True, slots=True)
class SetDuplex:
    """The session runs native full duplex (lockstep frames) from now on, or turns again."""

    session_id: str
    on: bool


@dataclass(frozen=True, slots=True)
class CloseSession:
    session_id: str


@dataclass(frozen=True, slots=True)
class Instruct:
    """The session's instructions and tools changed (the model places its system turn)."""

    session_id: str
    instructions: str
    tools: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class Barrier:
    """Answered with a Report and then a Reply once every request before it is applied."""

    token: int


@dataclass(frozen=True, slots=True)
class Query:
    """Run `fn(model)` on the engine's thread, where the model lives; answered with a Reply
    holding its result. For measurements run while the engine is idle. `fn` is a module-level
    function, so it crosses to an engine process by name."""

    token: int
    fn: Callable[[Any], Any]


Request = (
    OpenSession | PushAudio | PushFrame | PushText | Instruct | Commit | ClearInput
    | CancelReply | CloseSession | Barrier | Query | SetDuplex
)
SESSION_REQUESTS = (PushAudio, PushFrame, PushText, Instruct, Commit, ClearInput, CancelReply,
                    CloseSession, SetDuplex)
"""Requests about one open session: moot once it is closed."""

# -- outputs ----------------------------------------------------------------------------------

SessionEvent = (AudioOut | TextOut | ToolCallOut | ResponseFinished | ResponseTimings
                | SessionFailed | DuplexOut | DuplexDropped | ReplyTokens)


@dataclass(frozen=True, slots=True)
class StepEvents:
    """The per-session events of one engine step, in order: one message a step rather than
    one per event, so an engine process pickles and writes once per step."""

    events: tuple[SessionEvent, ...]


@dataclass(frozen=True, slots=True)
class Report:
    """What the core holds and measured since the last report."""

    bytes_by_session: dict[str, int]
    drops: list[Drop]
    stage_samples: dict[str, tuple[list[float], list[float], list[int]]]
    load: float
    busy_s: float
    steps: int
    """Steps that ran a plan, since the core started (busy_s is their time)."""
    alive: bool
    """False in the core's last report, sent as its thread dies of an error."""
    caches: dict[str, CacheStats] = field(default_factory=dict)
    """The model's cross-session caches (`DuplexModel.cache_stats`)."""
    duplex_tick: TickCost | None = None
    """The measured cost of a lockstep tick of the duplex sessions, None before any."""
    busy_cpu_s: float = 0.0
    """CPU time the core's thread had during its busy_s: less than busy_s when other work
    shares the cores and the engine waits for one."""
    kv: dict[str, KVStats] = field(default_factory=dict)
    """The model's paged KV pools by stage (`DuplexModel.kv_stats`)."""
    sessions: int = 0
    """Sessions the core holds: those a caller opened since are not in `kv` yet."""
    graphs: dict[str, dict[str, int]] = field(default_factory=dict)
    """The model's fixed-shape steps since it started, by stage and how they ran
    (`DuplexModel.graph_stats`: CUDA graph replays, fixed buffers, eager)."""


@dataclass(frozen=True, slots=True)
class Reply:
    token: int
    value: Any = None
    error: str | None = None


Output = SessionEvent | StepEvents | Report | Reply
