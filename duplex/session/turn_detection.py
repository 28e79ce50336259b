"""Turn decisions from per-chunk speech probabilities, and from end-of-turn scores: pure logic
on the sample clock.

The probabilities come from a model (duplex.engine.vad); the decisions are plain logic: speech
starts when a chunk reaches `threshold` (or the chunk still filling, scored ahead, does).

server_vad: the turn ends after `silence_samples` of chunks below it.

semantic_vad (`pause_samples` set): at a short pause the detector asks whether the turn is
complete (`ScoreTurn`; duplex.smart_turn answers); a score at or above `complete_threshold`
for the pause now under way ends the turn, anything else leaves it open, and a pause that
reaches `silence_samples` (eagerness's longest wait) ends it anyway.
"""

from dataclasses import dataclass

from duplex.session.commands import SpeechStarted, SpeechStopped
from duplex.session.timeline import require_count

SEMANTIC_PAUSE_MS = 200
"""semantic_vad asks the end-of-turn model once a pause has lasted this long."""
EAGERNESS_WAIT_MS = {"low": 8000, "medium": 4000, "auto": 4000, "high": 2000}
"""semantic_vad's eagerness as its longest wait (OpenAI's documented timeouts): a pause the
model did not judge complete ends the turn after this long."""


@dataclass(frozen=True, slots=True)
class ScoreTurn:
    """Ask the end-of-turn model whether the turn whose speech began at `onset` and paused at
    `end` (clock samples, the pause's silence included) is complete. Only the answer to the
    latest `request` counts, and only while the pause it was asked in lasts."""

    request: int
    onset: int
    end: int


@dataclass
class TurnDetector:
    threshold: float = 0.5
    silence_samples: int = 12000
    prefix_samples: int = 7200
    pause_samples: int | None = None
    """semantic_vad: silence after which the turn is scored; None: server_vad."""
    complete_threshold: float = 0.5
    position: int = 0
    speaking: bool = False
    silence_run: int = 0
    speech_end: int = 0
    onset: int = 0
    """Where the turn's speech began (its first onset: pauses inside a turn do not move it)."""
    asked: int | None = None
    """The request whose answer may end the turn now; None when none may."""
    requests: int = 0

    @property
    def deciding(self) -> bool:
        """Speech has paused and the pause is running towards the point where the turn is
        decided (scored, or ended by silence): the detector's next verdicts are on the path
        to the reply."""
        due = self.silence_samples if self.pause_samples is None else self.pause_samples
        return self.speaking and 0 < self.silence_run < due

    def forget_speech(self) -> None:
        """End the current speech without a decision (it was judged a false interruption)."""
        self.speaking = False
        self.silence_run = 0
        self.asked = None

    def _start(self, at: int) -> SpeechStarted:
        self.speaking = True
        self.silence_run = 0
        self.onset = at
        self.asked = None
        return SpeechStarted(at)

    def _stop(self, ended_by: str) -> SpeechStopped:
        self.speaking = False
        self.silence_run = 0
        self.asked = None
        return SpeechStopped(self.speech_end, ended_by)

    def feed_early(self, prob: float) -> SpeechStarted | None:
        """The chunk still filling, scored ahead (duplex.engine.vad `early`): speech starts
        there if it reaches `threshold`. Its chunk, once fed, goes on from that start; if it
        is no speech after all, the silence that follows ends it as any speech ends."""
        if self.speaking or prob < self.threshold:
            return None
        self.speech_end = self.position
        return self._start(self.position)

    def feed(self, prob: float, n_samples: int) -> SpeechStarted | SpeechStopped | ScoreTurn | None:
        """Account one chunk of `n_samples` whose speech probability is `prob`."""
        require_count("n_samples", n_samples)
        start = self.position
        self.position += n_samples
        if prob >= self.threshold:
            self.silence_run = 0
            self.speech_end = self.position
            # Speech again: an answer about the pause before it no longer says anything.
            self.asked = None
            return None if self.speaking else self._start(start)
        if not self.speaking:
            return None
        pause_before = self.silence_run
        self.silence_run += n_samples
        if self.silence_run >= self.silence_samples:
            return self._stop("silence" if self.pause_samples is None else "fallback")
        if self.pause_samples is not None and pause_before < self.pause_samples <= self.silence_run:
            self.requests += 1
            self.asked = self.requests
            return ScoreTurn(self.requests, self.onset, self.position)
        return None

    def score(self, request: int, complete: float | None) -> SpeechStopped | None:
        """The end-of-turn model's answer to `request`: the probability that the turn is
        complete (None: it could not judge). A complete turn ends at its speech's end."""
        if (not self.speaking or request != self.asked or complete is None
                or complete < self.complete_threshold):
            return None
        return self._stop("model")
