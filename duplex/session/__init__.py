"""The session core: a pure, synchronous state machine with no I/O.

Transports translate wire messages into commands, feed them to `Session.handle`, and act on
the events it returns. Nothing here imports asyncio or any transport, so it is tested in
microseconds and reasoned about without an event loop.
"""

from duplex.session.commands import (
    AudioReceived,
    Cancel,
    Close,
    Command,
    InputConsumed,
    InputDropped,
    OutputChunkProduced,
    OutputDelivered,
    PlaybackAcknowledged,
    ResponseCompleted,
    SpeechStarted,
    SpeechStopped,
    StartResponse,
    Tick,
    Truncate,
    VideoFrameReceived,
)
from duplex.session.errors import (
    AckBeyondSent,
    InvalidCommand,
    NoActiveResponse,
    SessionClosed,
    SessionError,
    UnknownCommand,
)
from duplex.session.events import (
    ChunkRefused,
    EpochBumped,
    Event,
    Flush,
    OutputChunk,
    Released,
    ResponseCancelled,
    ResponseDone,
    ResponseStarted,
    TranscriptTruncated,
    TurnChanged,
    UserTurnEnded,
    VideoFrameSampled,
)
from duplex.session.state import Session, TurnState
from duplex.session.timeline import TrackCounters

__all__ = [
    "AckBeyondSent",
    "AudioReceived",
    "Cancel",
    "ChunkRefused",
    "Close",
    "Command",
    "EpochBumped",
    "Event",
    "Flush",
    "InputConsumed",
    "InputDropped",
    "InvalidCommand",
    "NoActiveResponse",
    "OutputChunk",
    "OutputChunkProduced",
    "OutputDelivered",
    "PlaybackAcknowledged",
    "Released",
    "ResponseCancelled",
    "ResponseCompleted",
    "ResponseDone",
    "ResponseStarted",
    "Session",
    "SessionClosed",
    "SessionError",
    "SpeechStarted",
    "SpeechStopped",
    "StartResponse",
    "Tick",
    "TrackCounters",
    "TranscriptTruncated",
    "Truncate",
    "TurnChanged",
    "TurnState",
    "UnknownCommand",
    "UserTurnEnded",
    "VideoFrameReceived",
    "VideoFrameSampled",
]
