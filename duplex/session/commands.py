"""Commands fed into the session core. Sample counts are integers on the session clock."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AudioReceived:
    track: str
    n_samples: int


@dataclass(frozen=True, slots=True)
class VideoFrameReceived:
    """A camera frame whose presentation time is `pts_sample` on the input audio clock."""

    pts_sample: int


@dataclass(frozen=True, slots=True)
class InputConsumed:
    """The encoder took `n` units (samples, or frames for video) out of the track's buffer."""

    track: str
    n: int


@dataclass(frozen=True, slots=True)
class InputDropped:
    track: str
    n: int
    reason: str


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    at_sample: int


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    at_sample: int
    ended_by: str = "silence"
    """What ended the turn: silence (server_vad's silence_duration_ms), model (the end-of-turn
    model judged it complete at a pause) or fallback (semantic_vad's longest wait)."""


@dataclass(frozen=True, slots=True)
class VoiceActivity:
    """The speech detector scored the input up to `end_sample`: speech (at or above its
    threshold) or not. Fed for every scored chunk; it is what tells a pause's speech apart
    from a false interruption."""

    end_sample: int
    speech: bool


@dataclass(frozen=True, slots=True)
class SetInterruption:
    """Speech over a reply pauses it; only speech lasting `min_samples` cancels it. A pause
    whose speech has been quiet for `resume_gap_samples` when that much time has passed since
    its onset (or any time later) resumes the reply.
    `min_samples` 0: speech over a reply cancels it at once."""

    min_samples: int
    resume_gap_samples: int


@dataclass(frozen=True, slots=True)
class StartResponse:
    pass


@dataclass(frozen=True, slots=True)
class OutputChunkProduced:
    """The model produced `n_samples` of reply audio (and the text spoken in it) in `epoch`."""

    epoch: int
    n_samples: int
    text: str = ""


@dataclass(frozen=True, slots=True)
class ResponseCompleted:
    """The model finished generating the reply of `epoch`."""

    epoch: int


@dataclass(frozen=True, slots=True)
class OutputDelivered:
    """The output track up to `end_sample` (absolute) has been handed to the listener's
    carrier: the most of it a listener can have played."""

    end_sample: int


@dataclass(frozen=True, slots=True)
class PlaybackAcknowledged:
    """The listener has heard the output track up to `played_sample` (absolute)."""

    played_sample: int


@dataclass(frozen=True, slots=True)
class Truncate:
    """The listener heard `audio_end_sample` samples of response `response_id`, no more."""

    response_id: int
    audio_end_sample: int


@dataclass(frozen=True, slots=True)
class Cancel:
    reason: str


@dataclass(frozen=True, slots=True)
class Close:
    reason: str = "closed"


@dataclass(frozen=True, slots=True)
class Tick:
    """The transport's clock reached `now_sample` on the input timeline."""

    now_sample: int


Command = (
    AudioReceived
    | VideoFrameReceived
    | InputConsumed
    | InputDropped
    | SpeechStarted
    | SpeechStopped
    | VoiceActivity
    | SetInterruption
    | StartResponse
    | OutputChunkProduced
    | ResponseCompleted
    | OutputDelivered
    | PlaybackAcknowledged
    | Truncate
    | Cancel
    | Close
    | Tick
)
