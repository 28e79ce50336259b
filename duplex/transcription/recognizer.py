"""What every speech recogniser offers the transcription service."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np


def as_pcm(pcm: np.ndarray) -> np.ndarray:
    """The audio as 1-D float32, or ValueError naming what is wrong with it."""
    array = np.asarray(pcm, dtype=np.float32)
    if array.ndim != 1:
        raise ValueError(f"audio must be mono (1-D), got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("audio holds NaN or infinite samples")
    return array


class Recognizer(ABC):
    """Speech to text for 16 kHz float32 mono audio.

    The model loads on first use, on whichever thread transcribes first, so resolving a name
    on the event loop costs nothing. One lock covers loading and recognition: model objects
    are not all safe to call from two threads at once.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loaded = False

    def transcribe(self, pcm: np.ndarray) -> str:
        return self.transcribe_batch([pcm])[0]

    def transcribe_batch(self, pcms: Sequence[np.ndarray]) -> list[str]:
        """One text per utterance, recognised together where the model can batch them."""
        checked = [as_pcm(p) for p in pcms]
        with self._lock:
            if not self._loaded:
                self._load()
                self._loaded = True
            return self._recognize(checked)

    @abstractmethod
    def _load(self) -> None: ...

    @abstractmethod
    def _recognize(self, pcms: list[np.ndarray]) -> list[str]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
