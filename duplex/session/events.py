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
class OutputPaused:
    """Speech began over reply `response_id` at input sample `onset`: release nothing more of
    it until the speech is judged. Its audio stays queued, in place on the output track."""

    response_id: int
    onset: int


@dataclass(frozen=True, slots=True)
class OutputResumed:
    """The speech from `onset` to `speech_end` was a false interruption: the paused reply goes
    on from where it stopped."""

    response_id: int
    onset: int
    speech_end: int


@dataclass(frozen=True, slots=True)
class InterruptionConfirmed:
    """The speech that began at `onset` lasted long enough: the user's turn has begun (the
    reply it interrupted, if any, is cancelled by the events beside this one)."""

    onset: int


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
    | OutputPaused
    | OutputResumed
    | InterruptionConfirmed
    | VideoFrameSampled
    | Released
)
