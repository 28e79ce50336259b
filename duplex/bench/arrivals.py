"""When the bench's sessions start, what each turn says, and how long they pause.

Every turn says one of the bench's recordings (duplex.bench.speech), from its onset. `herd` is
the worst case: every session starts within the first second and says the first 1-2 s of a
recording, so at the largest real-time count nearly all of them reply at once. `poisson` spreads
the starts as a Poisson process over the first half of the run, says whole recordings, pauses a
random while after each reply, and barges in on half the replies, at random: the load of callers
who come and talk at their own pace. Both are drawn from `seed`, so a run can be repeated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from duplex.bench.speech import lengths_s

ARRIVALS = ("herd", "poisson")
MEAN_PAUSE_S = 1.0
"""Poisson callers' mean pause between the end of a reply and their next turn."""
HERD_PAUSE_S = 0.5


@dataclass(frozen=True)
class Script:
    """One session's plan: when it starts (seconds after the run's start), and per turn."""

    start_s: float
    utterance: tuple[int, ...]
    """Which recording each turn says (an index into duplex.bench.speech.TEXTS)."""
    turn_s: tuple[float, ...]
    """How much of it: its first seconds."""
    barge_in: tuple[bool, ...]
    """Whether the caller talks over the reply to that turn."""
    pause_s: tuple[float, ...]
    """Silence after a reply heard to its end, before the next turn."""


def scripts(arrivals: str, n: int, duration_s: float, seed: int = 0) -> list[Script]:
    """The scripts of `n` sessions of a run of `duration_s`."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, not {arrivals!r}")
    # A client cycles through its turns if it needs more.
    turns = int(duration_s // 2) + 2
    if arrivals == "herd":
        return [_herd(random.Random((seed << 32) | i), turns) for i in range(n)]
    rng = random.Random(seed)
    # A Poisson process that brings n sessions in a window places them uniformly at random in
    # it; the window is the first half of the run, so the last arrival still talks a while.
    starts = sorted(rng.uniform(0, duration_s / 2) for _ in range(n))
    return [_poisson(rng, start, turns) for start in starts]


def _herd(rng: random.Random, turns: int) -> Script:
    start = rng.uniform(0, 1.0)
    said = tuple(rng.randrange(len(lengths_s())) for _ in range(turns))
    return Script(
        start,
        said,
        tuple(min(rng.uniform(1.0, 2.0), lengths_s()[u]) for u in said),
        tuple(k % 2 == 1 for k in range(turns)),
        (HERD_PAUSE_S,) * turns,
    )


def _poisson(rng: random.Random, start: float, turns: int) -> Script:
    said = tuple(rng.randrange(len(lengths_s())) for _ in range(turns))
    return Script(
        start,
        said,
        tuple(lengths_s()[u] for u in said),
        tuple(rng.random() < 0.5 for _ in range(turns)),
        tuple(rng.expovariate(1 / MEAN_PAUSE_S) for _ in range(turns)),
    )
