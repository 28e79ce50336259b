"""Native full-duplex sessions on the Realtime protocol (`turn_detection: {"type": "duplex"}`).

The model hears every input frame and answers every frame, mostly with silence, deciding
itself when to speak. What the client sees is spoken segments: a segment begins at the
model's first voiced frame (`response.created`), carries its frames as audio and transcript
deltas, and ends (`response.done`) once the model has been silent for the configured stretch.
Silent frames inside a segment are held and sent only if the model speaks again before the
stretch is over, so a reply's audio runs from its first voiced frame to its last.

A cancel (response.cancel, output_audio_buffer.clear) fences the segment under way: its
frames, in flight or still to come, are dropped until the model falls silent for the stretch;
the model itself keeps listening and speaking, and its next segment is a new response.

Pure: frames in, segment actions out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NATIVE_MODELS = ("echo", "tiny-moshi", "a Moshi checkpoint")
"""What can run native duplex, as a client is told when its model cannot."""
MODEL_PARAM = "session.audio.input.turn_detection.type"
BETA_PARAM = "session.turn_detection.type"


@dataclass(frozen=True)
class SegmentStart:
    epoch: int
    at: int
    """Where its first frame lies on the session's timeline (model output samples)."""


@dataclass(frozen=True)
class SegmentAudio:
    epoch: int
    pcm: Any
    text: str


@dataclass(frozen=True)
class SegmentEnd:
    epoch: int


SegmentAction = SegmentStart | SegmentAudio | SegmentEnd


@dataclass
class DuplexSegments:
    silence_samples: int
    """Silence (output samples) that ends a segment and lifts a cancel's fence."""
    epoch: int = 0
    speaking: bool = False
    fenced: bool = False
    silent_run: int = 0
    held: list[tuple[Any, str]] = field(default_factory=list)
    dropped_frames: int = 0
    """Frames of a cancelled segment or an old epoch that were never sent."""

    def frame(self, epoch: int, pcm: Any, text: str, voiced: bool,
              at: int = 0) -> list[SegmentAction]:
        if epoch < self.epoch:
            self.dropped_frames += 1
            return []
        self.epoch = epoch
        if self.fenced:
            self.dropped_frames += 1
            self.silent_run = 0 if voiced else self.silent_run + len(pcm)
            if self.silent_run >= self.silence_samples:
                self.fenced, self.silent_run = False, 0
            return []
        if not self.speaking:
            if not voiced:
                return []
            self.speaking, self.silent_run = True, 0
            return [SegmentStart(epoch, at), SegmentAudio(epoch, pcm, text)]
        if voiced:
            out = [SegmentAudio(epoch, p, t) for p, t in self.held]
            self.held, self.silent_run = [], 0
            return out + [SegmentAudio(epoch, pcm, text)]
        self.held.append((pcm, text))
        self.silent_run += len(pcm)
        if self.silent_run < self.silence_samples:
            return []
        self.held, self.speaking, self.silent_run = [], False, 0
        return [SegmentEnd(epoch)]

    def cancel(self, new_epoch: int) -> None:
        """The segment under way is over for the client; the model goes on."""
        self.epoch = max(self.epoch, new_epoch)
        if self.speaking:
            self.dropped_frames += len(self.held)
            self.speaking, self.fenced, self.held, self.silent_run = False, True, [], 0


def not_native(model: str, param: str, capable: tuple[str, ...]) -> str:
    return (f"Invalid value for '{param}': model '{model}' runs turn by turn and cannot run "
            f"native duplex; models that can: {', '.join(capable)}.")
