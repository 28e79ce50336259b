"""Server VAD decisions from per-chunk speech probabilities: pure hysteresis on the sample clock.

The probabilities come from a model (duplex.engine.vad); the decisions are plain logic: speech starts
when a chunk reaches `threshold` (or the chunk still filling, scored ahead, does), and stops after
`silence_samples` of chunks below it.
"""

from dataclasses import dataclass

from duplex.session.commands import SpeechStarted, SpeechStopped
from duplex.session.timeline import require_count


@dataclass
class TurnDetector:
    threshold: float = 0.5
    silence_samples: int = 12000
    prefix_samples: int = 7200
    position: int = 0
    speaking: bool = False
    silence_run: int = 0
    speech_end: int = 0

    def forget_speech(self) -> None:
        """End the current speech without a decision (it was judged a false interruption)."""
        self.speaking = False
        self.silence_run = 0

    def feed_early(self, prob: float) -> SpeechStarted | None:
        """The chunk still filling, scored ahead (duplex.engine.vad `early`): speech starts
        there if it reaches `threshold`. Its chunk, once fed, goes on from that start; if it
        is no speech after all, the silence that follows ends it as any speech ends."""
        if self.speaking or prob < self.threshold:
            return None
        self.speaking = True
        self.silence_run = 0
        self.speech_end = self.position
        return SpeechStarted(self.position)

    def feed(self, prob: float, n_samples: int) -> SpeechStarted | SpeechStopped | None:
        """Account one chunk of `n_samples` whose speech probability is `prob`."""
        require_count("n_samples", n_samples)
        start = self.position
        self.position += n_samples
        if prob >= self.threshold:
            self.silence_run = 0
            self.speech_end = self.position
            if not self.speaking:
                self.speaking = True
                return SpeechStarted(start)
            return None
        if not self.speaking:
            return None
        self.silence_run += n_samples
        if self.silence_run >= self.silence_samples:
            self.speaking = False
            self.silence_run = 0
            return SpeechStopped(self.speech_end)
        return None
