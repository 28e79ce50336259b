"""What reaches a session's loop, as typed messages, urgent ones first.

Everything that happens to a session (frames from its peer, engine results, speech
probabilities, clock ticks, its end) goes through one inbox, so the pure protocol core is only
ever touched from the event loop. Urgent messages overtake the rest, as Pipecat's system frames
overtake its data frames: speech probabilities (a barge-in must not wait behind queued reply
audio it is about to make stale) and the session's end. The peer's own frames come next, so a
client's cancel or clear overtakes queued reply audio too; within each class the order is kept.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class PeerText:
    text: str


@dataclass(frozen=True, slots=True)
class PeerBytes:
    data: bytes


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """An engine event for this session (AudioOut, TextOut, ToolCallOut, ResponseFinished,
    ResponseTimings, SessionFailed)."""

    event: Any


@dataclass(frozen=True, slots=True)
class SpeechProbs:
    probs: list[float]
    early: float | None = None
    """The latest audio's probability ahead of the chunk grid (duplex.engine.vad)."""


@dataclass(frozen=True, slots=True)
class TurnScored:
    """The end-of-turn model's answer to a session's `request`: the probability that the
    turn is complete, or None when it could not judge."""

    request: int
    complete: float | None


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class CarrierGone:
    """The connection ended without a word: nobody is left to tell anything."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The server is stopping (or taking the session away): close with `code`."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class MediaAudio:
    """Float32 mono at the session clock's rate from a media track (WebRTC)."""

    pcm: np.ndarray


@dataclass(frozen=True, slots=True)
class MediaFrame:
    """A camera frame whose time on the input clock is `pts_sample`."""

    frame: Any
    pts_sample: int


@dataclass(frozen=True, slots=True)
class Fenced:
    """The session was resumed on another connection; this one no longer serves it."""


@dataclass(frozen=True, slots=True)
class TranscriptReady:
    item_id: str
    result: Any
    """A duplex.transcription.TranscriptionResult."""
    partial: bool = False
    """Of audio not yet committed."""


@dataclass(frozen=True, slots=True)
class McpListed:
    """An MCP server's tools (or why there are none) for the listing item `item_id`."""

    item_id: str
    tools: list[dict[str, Any]] | None
    error: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class McpCalled:
    """An MCP tool's output (or why there is none) for the call item `item_id`."""

    item_id: str
    output: str | None
    error: dict[str, Any] | None


Message = (
    PeerText | PeerBytes | EngineOutput | SpeechProbs | TurnScored | Tick | CarrierGone
    | Shutdown | MediaAudio | MediaFrame | Fenced | TranscriptReady | McpListed | McpCalled
)

_URGENT = (SpeechProbs, TurnScored, CarrierGone, Shutdown, Fenced)
_FROM_PEER = (PeerText, PeerBytes, MediaAudio, MediaFrame)


def priority(message: Message) -> int:
    """0: urgent; 1: the peer's frames, in the order it sent them (a client's cancel overtakes
    queued reply audio, never the client's own earlier events); 2: engine output and ticks."""
    if isinstance(message, _URGENT):
        return 0
    if isinstance(message, _FROM_PEER):
        return 1
    return 2


class Inbox:
    """An asyncio queue by `priority`, each class in arrival order.
    `put` is for the event loop's own thread; other threads go through `loop.call_soon_threadsafe`."""

    def __init__(self) -> None:
        self._queue: asyncio.PriorityQueue[tuple[int, int, Message]] = asyncio.PriorityQueue()
        self._seq = itertools.count()

    def put(self, message: Message) -> None:
        self._queue.put_nowait((priority(message), next(self._seq), message))

    async def get(self) -> Message:
        return (await self._queue.get())[2]

    def qsize(self) -> int:
        return self._queue.qsize()
