"""PCM16 little-endian bytes <-> float32 in [-1, 1)."""

import numpy as np


class PcmError(ValueError):
    pass


def pcm16_to_float(data: bytes) -> np.ndarray:
    if len(data) % 2:
        raise PcmError(f"PCM16 needs an even number of bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(samples: np.ndarray) -> bytes:
    scaled = np.clip(np.asarray(samples, dtype=np.float32) * 32768.0, -32768, 32767)
    return np.round(scaled).astype("<i2").tobytes()
