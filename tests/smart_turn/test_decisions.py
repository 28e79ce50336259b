"""semantic_vad's decisions on all 32 recorded sentences, through the real speech detector
and the real Smart Turn (no engine, no clock): a finished sentence ends by the model at its
pause and never at a pause between its words; a sentence paused 600-900 ms in the middle is
replied to early less often than server_vad does (always: its 500 ms of silence pass first)."""

import numpy as np
import pytest

from duplex.bench.prompts import prompts
from duplex.engine.vad import SileroVAD, VadStream
from duplex.session.commands import SpeechStopped
from duplex.session.turn_detection import (
    SEMANTIC_ASK_MS,
    SEMANTIC_PAUSE_MS,
    ScoreTurn,
    TurnDetector,
)
from duplex.smart_turn import SmartTurn

RATE = 16000
CHUNK = 512


def with_silence(speech: np.ndarray) -> np.ndarray:
    """0.5 s of silence, the speech, 2 s of silence."""
    return np.concatenate([np.zeros(RATE // 2, np.float32), speech, np.zeros(2 * RATE, np.float32)])


def turn_end(model: SmartTurn, audio: np.ndarray, probs: list[float]) -> tuple[str, bool]:
    """How the turn in `audio` (from with_silence) ends, given the detector's probabilities,
    and whether that was before the speech's last sample."""
    end = len(audio) - 2 * RATE
    d = TurnDetector(silence_samples=4 * RATE, prefix_samples=300 * RATE // 1000,
                     pause_samples=SEMANTIC_PAUSE_MS * RATE // 1000,
                     ask_samples=SEMANTIC_ASK_MS * RATE // 1000)
    for prob in probs:
        out = d.feed(prob, CHUNK)
        if isinstance(out, ScoreTurn):
            start = max(0, out.onset - d.prefix_samples)
            out = d.score(out.request, model.complete([audio[start : out.end]])[0])
        if isinstance(out, SpeechStopped):
            return out.ended_by, d.position < end
    return "none", False


@pytest.mark.cpu_bound
@pytest.mark.slow
def test_finished_sentences_end_at_the_pause_and_paused_ones_mostly_wait(smart_turn_path):
    model = SmartTurn(smart_turn_path)
    rng = np.random.default_rng(0)
    whole = [with_silence(p.pcm) for p in prompts()]
    cut = [with_silence(p.paused(int(RATE * rng.uniform(0.6, 0.9)))) for p in prompts()]
    # One batched detector pass over every recording, as the server batches its sessions.
    probs = SileroVAD().process([VadStream() for _ in whole + cut], whole + cut)
    finished = [turn_end(model, a, pr) for a, pr in zip(whole, probs[: len(whole)], strict=True)]
    paused = [turn_end(model, a, pr) for a, pr in zip(cut, probs[len(whole) :], strict=True)]
    assert not [f for f in finished if f[1]], "a finished sentence was cut at a pause inside it"
    assert sum(by == "model" for by, _ in finished) >= 30, finished
    early = sum(before for _, before in paused)
    assert early <= len(paused) // 2, paused
