"""What streaming codec decoding costs against the codec's own offline decoding, and how exactly
it matches it.

Streaming goes through the adapter's own `codec_decode`, one frame per call with every session
in the same call, as the engine drives it; offline is the adapter's `offline_codec`, all frames
of all sessions in one call. Both costs are per frame of one session, best of `repeats` runs so
that noise from other processes does not count. A codec at real widths on a CPU costs a third
of a second a frame, so the frame count shrinks to what fits a time budget.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from models.base import DuplexModel, OfflineCodec

BATCHES = (1, 8)
BUDGET_S = 60.0
STREAM_OVER_OFFLINE = 5
"""Streaming one frame a call costs up to ~4x offline decoding; the budget assumes 5."""


def stream_vs_offline(
    model: DuplexModel,
    n_frames: int = 50,
    repeats: int = 3,
    batches: tuple[int, ...] = BATCHES,
    budget_s: float = BUDGET_S,
) -> dict[str, dict[str, Any]] | None:
    """{"batch_N": figures} for N sessions decoded together; None for a model without a codec.
    At most `n_frames` frames, fewer (at least 2) where more would not fit `budget_s`."""
    codec = model.offline_codec()
    if codec is None:
        return None
    n_frames = affordable_frames(codec, n_frames, repeats * sum(batches), budget_s)
    return {f"batch_{n}": measure(model, codec, n_frames, repeats, n) for n in batches}


def affordable_frames(codec: OfflineCodec, n_frames: int, streams: int, budget_s: float) -> int:
    """How many frames `streams` streams can each decode, offline and streamed, in the budget,
    from the cost of an offline decode of two frames (the faster of two: the first call pays
    for one-time setup)."""
    probe = np.zeros((1, codec.codebooks, 2), dtype=np.int64)
    per_frame_s = math.inf
    for _ in range(2):
        start = time.perf_counter()
        codec.decode(probe)
        per_frame_s = min(per_frame_s, (time.perf_counter() - start) / 2)
    per_stream_frame_s = per_frame_s * (1 + STREAM_OVER_OFFLINE) * streams
    return max(2, min(n_frames, int(budget_s / max(per_stream_frame_s, 1e-9))))


def measure(
    model: DuplexModel, codec: OfflineCodec, n_frames: int, repeats: int, sessions: int
) -> dict[str, Any]:
    codes = np.random.default_rng(0).integers(
        0, codec.codebook_size, (sessions, codec.codebooks, n_frames)
    )
    offline_s = stream_s = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        reference = codec.decode(codes)
        offline_s = min(offline_s, time.perf_counter() - start)
        states = [model.new_state(f"codec-bench-{i}") for i in range(sessions)]
        try:
            start = time.perf_counter()
            chunks = [model.codec_decode(states, list(codes[:, :, t])) for t in range(n_frames)]
            stream_s = min(stream_s, time.perf_counter() - start)
        finally:
            for state in states:
                model.free(state)
    streamed = np.stack([np.concatenate(pcm) for pcm in zip(*chunks, strict=True)])
    diff = np.abs(streamed[:, codec.delay_samples :] - reference).max().item()
    rms = np.sqrt(np.mean(np.square(reference, dtype=np.float64))).item()
    per_frame_ms = 1e3 / (n_frames * sessions)
    return {
        "n_frames": n_frames,
        "sessions": sessions,
        "offline_ms_per_frame": offline_s * per_frame_ms,
        "stream_ms_per_frame": stream_s * per_frame_ms,
        "ratio": stream_s / offline_s,
        "max_abs_diff": diff,
        "signal_rms": rms,
        "diff_over_rms": diff / rms if rms else None,
    }
