"""Events and actions the session core returns for the transport to carry out."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """One piece of reply audio, placed on the session's output track."""

    epoch: int
    seq: int
    start_sample: int
    n_samples: int
    response_id: int
    text: str = ""


@dataclass(frozen=True, slots=True)
class ChunkRefused:
    epoch: int
    current_epoch: int
    n_samples: int
    reason: str


@dataclass(frozen=True, slots=True)
class TurnChanged:
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class UserTurnEnded:
    start_sample: int
    end_sample: int


@dataclass(frozen=True, slots=True)
class ResponseStarted:
    response_id: int
    epoch: int
    start_sample: int


@dataclass(frozen=True, slots=True)
class ResponseDone:
    response_id: int
    epoch: int
    n_samples: int


@dataclass(frozen=True, slots=True)
class ResponseCancelled:
    response_id: int
    epoch: int
    reason: str
    heard_samples: int


@dataclass(frozen=True, slots=True)
class EpochBumped:
    old: int
    new: int
    reason: str


@dataclass(frozen=True, slots=True)
class Flush:
    """Drop every queued piece of output of `epoch` and older, here and at the client."""

    epoch: int


@dataclass(frozen=True, slots=True)
class TranscriptTruncated:
    response_id: int
    audio_end_sample: int
    heard_text: str


@dataclass(frozen=True, slots=True)
class VideoFrameSampled:
    pts_sample: int


@dataclass(frozen=True, slots=True)
class Released:
    """Everything the session held when it closed, named so a test can see it go."""

    items: tuple[tuple[str, int], ...]


Event = (
    OutputChunk
    | ChunkRefused
    | TurnChanged
    | UserTurnEnded
    | ResponseStarted
    | ResponseDone
    | ResponseCancelled
    | EpochBumped
    | Flush
    | TranscriptTruncated
    | VideoFrameSampled
    | Released
)
