"""Turn decisions from per-chunk speech probabilities, and from end-of-turn scores: pure logic
on the sample clock.

The probabilities come from a model (duplex.engine.vad); the decisions are plain logic: speech
starts when a chunk reaches `threshold` (or the chunk still filling, scored ahead, does).

server_vad: the turn ends after `silence_samples` of chunks below it.

semantic_vad (`pause_samples` set): a pause of `pause_samples` ends a turn the end-of-turn
model judges complete. The detector asks it (`ScoreTurn`; duplex.smart_turn answers) a little
earlier in the pause, at `ask_samples`, so that its answer is usually in by then: a score at
or above `complete_threshold` for the pause now under way ends the turn once the pause has
lasted `pause_samples`, anything else leaves it open, and a pause that reaches
`silence_samples` (eagerness's longest wait) ends it anyway.
"""

from dataclasses import dataclass

from duplex.session.commands import SpeechStarted, SpeechStopped
from duplex.session.timeline import require_count

SEMANTIC_PAUSE_MS = 200
"""semantic_vad ends a turn the end-of-turn model judges complete once a pause has lasted this
long. On the recorded sentences (duplex.bench.prompts, through silero and Smart Turn) no
finished sentence was cut at a pause between its words with 200 ms; with 100-130 ms, 9 of 32
were."""
SEMANTIC_ASK_MS = 100
"""...and asks the model this far into the pause: its ~50 ms then pass while the pause grows
to SEMANTIC_PAUSE_MS (scored with less trailing silence, the model judged as many finished
sentences complete and more cut ones incomplete)."""
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
    """semantic_vad: the pause that ends a turn judged complete; None: server_vad."""
    ask_samples: int | None = None
    """semantic_vad: how far into a pause the model is asked (pause_samples if None)."""
    complete_threshold: float = 0.5
    position: int = 0
    speaking: bool = False
    silence_run: int = 0
    speech_end: int = 0
    onset: int = 0
    """Where the turn's speech began (its first onset: pauses inside a turn do not move it)."""
    asked: int | None = None
    """The request whose answer may end the turn now; None when none may."""
    complete: bool = False
    """The model judged the turn complete in this pause, before it had lasted pause_samples."""
    requests: int = 0

    def deciding(self, chunk: int) -> bool:
        """Speech has paused, and the next `chunk` of silence brings the pause to a point
        where the turn is decided (asked about, ended when judged complete, or ended by
        silence): that verdict is on the path to the reply."""
        if not self.speaking:
            return False
        due = [self.silence_samples, self.pause_samples, self.ask_samples]
        return any(d is not None and self.silence_run < d <= self.silence_run + chunk
                   for d in due)

    def forget_speech(self) -> None:
        """End the current speech without a decision (it was judged a false interruption)."""
        self.speaking = False
        self.silence_run = 0
        self.asked, self.complete = None, False

    def _start(self, at: int) -> SpeechStarted:
        self.speaking = True
        self.silence_run = 0
        self.onset = at
        self.asked, self.complete = None, False
        return SpeechStarted(at)

    def _stop(self, ended_by: str) -> SpeechStopped:
        self.speaking = False
        self.silence_run = 0
        self.asked, self.complete = None, False
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
            self.asked, self.complete = None, False
            return None if self.speaking else self._start(start)
        if not self.speaking:
            return None
        pause_before = self.silence_run
        self.silence_run += n_samples
        if self.silence_run >= self.silence_samples:
            return self._stop("silence" if self.pause_samples is None else "fallback")
        if self.pause_samples is None:
            return None
        if self.complete and self.silence_run >= self.pause_samples:
            return self._stop("model")
        ask = self.pause_samples if self.ask_samples is None else self.ask_samples
        if pause_before < ask <= self.silence_run:
            self.requests += 1
            self.asked = self.requests
            return ScoreTurn(self.requests, self.onset, self.position)
        return None

    def score(self, request: int, complete: float | None) -> SpeechStopped | None:
        """The end-of-turn model's answer to `request`: the probability that the turn is
        complete (None: it could not judge). A complete turn ends at its speech's end, once
        its pause has lasted pause_samples (now, or when it has)."""
        if (not self.speaking or request != self.asked or complete is None
                or complete < self.complete_threshold):
            return None
        if self.silence_run < self.pause_samples:
            self.complete = True
            return None
        return self._stop("model")
