"""What streaming codec decoding costs against the codec's own offline decoding, and how exactly
it matches it.

Streaming goes through the adapter's own `codec_decode`, one frame per call with every session
in the same call, as the engine drives it; offline is the adapter's `offline_codec`, all frames
of all sessions in one call. Both costs are per frame of one session, best of `repeats` runs so
that noise from other processes does not count.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from models.base import DuplexModel, OfflineCodec

BATCHES = (1, 8)


def stream_vs_offline(
    model: DuplexModel, n_frames: int = 50, repeats: int = 3, batches: tuple[int, ...] = BATCHES
) -> dict[str, dict[str, Any]] | None:
    """{"batch_N": figures} for N sessions decoded together; None for a model without a codec."""
    codec = model.offline_codec()
    if codec is None:
        return None
    return {f"batch_{n}": measure(model, codec, n_frames, repeats, n) for n in batches}


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
