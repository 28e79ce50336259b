"""KV memory in the bench: per stage, the bytes the paged pools allocate against the bytes the
live contexts need, beside what the slot layout (a row per session, every row as long as the
longest) would hold for the same contexts.

Two measurements: the peak of a run (`KVPeak`, sampled from the engine's reports while the
sessions talk) and `mixed_contexts`: 64 sessions whose contexts range from a few dozen positions
to the model's limit, each given a reply's first step, measured where the model lives. The slot
layout's figure is arithmetic (rows times the longest context, rounded up as that pool rounded
its capacity), a lower bound of what it allocated: it also doubled rows and capacity as they
grew. Nothing here runs a model without paged KV (echo, Moshi): their figures are empty.
"""

from __future__ import annotations

import asyncio

import numpy as np

from models.base import KVStats, TextTurn
from models.reply import ReplySpec

MIXED_SESSIONS = 64
PIECE = 1024
"""Positions a probe session prefills per forward (its attention mask grows with their square)."""


def figures(stats: dict[str, KVStats]) -> dict[str, dict[str, int]]:
    return {stage: {"allocated_bytes": s.blocks_used * s.block_bytes,
                    "needed_bytes": s.needed_bytes,
                    "slot_pool_bytes": s.slot_pool_bytes}
            for stage, s in stats.items()}


class KVPeak:
    """The engine's KV figures at their largest during a run, per stage."""

    def __init__(self, engine, every_s: float = 0.25) -> None:
        self.engine, self.every_s = engine, every_s
        self.peak: dict[str, dict[str, int]] = {}

    def sample(self) -> None:
        for stage, now in figures(self.engine.kv_stats).items():
            if now["allocated_bytes"] >= self.peak.get(stage, {}).get("allocated_bytes", -1):
                self.peak[stage] = now

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.every_s)


def context_lengths(sessions: int, longest: int) -> list[int]:
    """Mixed context lengths, spread evenly on a log scale from 32 positions to `longest`."""
    return [int(n) for n in np.geomspace(32, longest, sessions)]


def mixed_contexts(model, sessions: int = MIXED_SESSIONS) -> dict | None:
    """`sessions` sessions of mixed context lengths (up to the model's `max_context`), each
    with a reply's first Thinker and Talker step: the pools' figures then, and how many replies
    the KV memory refused. Run where the model lives, while the engine is idle."""
    if not model.kv_stats():
        return None
    longest = getattr(getattr(model, "options", None), "max_context", 8192)
    lengths = context_lengths(sessions, longest - 64)
    states = [model.new_state(f"kv-probe-{i}") for i in range(sessions)]
    try:
        for st, n in zip(states, lengths, strict=True):
            for start in range(0, n, PIECE):
                model.thinker_prefill([st], [TextTurn("x" * min(PIECE, n - start))])
        for st in states:
            model.begin_response(st, ReplySpec(temperature=0.0))
        tokens = model.thinker_decode(states)
        model.talker_step(states, tokens)
        refused = sum(t.reason == "server_full" for t in tokens)
        return {"sessions": sessions, "context_positions": [min(lengths), max(lengths)],
                "replies_refused": refused, "kv": figures(model.kv_stats())}
    finally:
        for st in states:
            model.free(st)
