"""What every speech recogniser offers the transcription service."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def as_pcm(pcm: np.ndarray) -> np.ndarray:
    """The audio as 1-D float32, or ValueError naming what is wrong with it."""
    array = np.asarray(pcm, dtype=np.float32)
    if array.ndim != 1:
        raise ValueError(f"audio must be mono (1-D), got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("audio holds NaN or infinite samples")
    return array


@dataclass(frozen=True)
class Hints:
    """What a client tells the recogniser of one utterance."""

    language: str | None = None
    """ISO-639-1; None: the recogniser's own choice."""
    prompt: str | None = None
    """Text that came before, or words to expect."""
    prefix: str = ""
    """Text already sent as the transcript's start (partial deltas): the transcript goes on
    from it, where the recogniser can be made to."""


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

    def transcribe(self, pcm: np.ndarray, hints: Hints | None = None) -> str:
        return self.transcribe_batch([pcm], [hints or Hints()])[0]

    def transcribe_batch(self, pcms: Sequence[np.ndarray],
                         hints: Sequence[Hints] | None = None) -> list[str]:
        """One text per utterance, recognised together where the model can batch them."""
        checked = [as_pcm(p) for p in pcms]
        told = list(hints) if hints is not None else [Hints() for _ in checked]
        with self._lock:
            if not self._loaded:
                self._load()
                self._loaded = True
            return self._recognize(checked, told)

    def languages(self) -> tuple[str, ...] | None:
        """The languages it transcribes (ISO-639-1), read without loading the model; None:
        whatever it is told."""
        return None

    @abstractmethod
    def _load(self) -> None: ...

    @abstractmethod
    def _recognize(self, pcms: list[np.ndarray], hints: list[Hints]) -> list[str]: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
