"""What a protocol core asks its edge to do. The cores are pure: they return these, and the
session loop (duplex/transport/loop.py) or a transport's own edge carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.reply import ReplySpec


@dataclass(frozen=True)
class Send:
    event: dict[str, Any]


@dataclass(frozen=True)
class EnginePush:
    pcm: np.ndarray
    """Float32 at the model's input rate."""


@dataclass(frozen=True)
class EnginePushFrame:
    frame: Any
    """A sampled camera frame as the carrier decoded it (an RGB array or an av.VideoFrame)."""


@dataclass(frozen=True)
class EnginePushText:
    text: str
    role: str = "user"
    """user | tool (a function call's output) | system | assistant | function_call (the call
    as JSON {"name", "arguments"})"""


@dataclass(frozen=True)
class EngineMark:
    """A conversation item's part of the model's context starts here (models that rewind)."""

    key: int


@dataclass(frozen=True)
class EngineRewind:
    """The model's context back to where item part `key` started; it and all after it go.
    Back at the head, `system` (instructions, tools) opens the context again."""

    key: int
    system: tuple[str, tuple[dict[str, Any], ...]] | None = None


@dataclass(frozen=True)
class EngineReplay:
    """Lay item part `key` again, as the last `EngineRewind` took it out of the context."""

    key: int


@dataclass(frozen=True)
class EngineInstruct:
    """The session's instructions and tools, for the model's system turn."""

    instructions: str
    tools: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class EnginePushImage:
    data: bytes
    """An encoded image (PNG, JPEG, ...) from an input_image item."""


@dataclass(frozen=True)
class EngineCommit:
    epoch: int
    spec: ReplySpec = field(default_factory=ReplySpec)


@dataclass(frozen=True)
class EngineCancel:
    epoch: int


@dataclass(frozen=True)
class EngineClearInput:
    pass


@dataclass(frozen=True)
class EngineSetDuplex:
    """Run the session as native full duplex (on), or turn by turn again."""

    on: bool


@dataclass(frozen=True)
class VadFeed:
    pcm: np.ndarray
    """Float32 at 16 kHz for speech detection."""
    urgent: bool = False
    """A reply is playing or paused (a speech start pauses it), or this audio completes a
    pause in the user's speech that decides the turn (the verdict starts the reply): no
    batching wait."""


@dataclass(frozen=True)
class ScoreTurnEnd:
    """Ask the end-of-turn model (duplex.smart_turn) whether the turn in `pcm` (16 kHz, up to
    the pause now under way) is complete; its answer comes back as a TurnScored message."""

    request: int
    pcm: np.ndarray


@dataclass(frozen=True)
class TurnEnded:
    """The user's turn ended and was committed; `by` says what ended it (counted): silence,
    model or fallback (duplex.session.commands.SpeechStopped)."""

    by: str


@dataclass(frozen=True)
class PlayAudio:
    """Reply audio for a media track (WebRTC): float32 at 24 kHz from `start_sample`."""

    start_sample: int
    pcm: np.ndarray


@dataclass(frozen=True)
class FlushAudio:
    """Drop every queued frame of the media track at once (barge-in)."""


@dataclass(frozen=True)
class HoldAudio:
    """Stop playing the media track's queued frames at once, keeping them (speech over the
    reply, not yet judged)."""


@dataclass(frozen=True)
class ResumeAudio:
    """Play the held frames on from where they stopped (a false interruption)."""


@dataclass(frozen=True)
class CloseConnection:
    code: int
    reason: str


@dataclass(frozen=True)
class InvalidToolCall:
    """The model wrote a tool call that is not the JSON its template asks for (counted)."""

    name: str
    raw: str


@dataclass(frozen=True)
class InterruptionJudged:
    """Speech over a reply was judged: it cut the reply (`confirmed`), or it was a false
    interruption and the reply went on (counted)."""

    confirmed: bool
