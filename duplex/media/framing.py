"""Fixed-size framing of a sample stream; the remainder waits for the next push."""

import numpy as np


class Framer:
    def __init__(self, frame_samples: int, dtype: type = np.float32) -> None:
        if type(frame_samples) is not int or frame_samples <= 0:
            raise ValueError(f"frame_samples must be a positive int, got {frame_samples!r}")
        self.frame_samples = frame_samples
        self._pending = np.zeros(0, dtype=dtype)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def push(self, samples: np.ndarray) -> list[np.ndarray]:
        data = np.concatenate([self._pending, np.asarray(samples, dtype=self._pending.dtype)])
        n_full = len(data) // self.frame_samples * self.frame_samples
        frames = [data[i : i + self.frame_samples] for i in range(0, n_full, self.frame_samples)]
        self._pending = data[n_full:]
        return frames

    def flush(self) -> np.ndarray:
        """Hand back the partial frame (fewer than frame_samples) and start empty."""
        rest, self._pending = self._pending, self._pending[:0]
        return rest
