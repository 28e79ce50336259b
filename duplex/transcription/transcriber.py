"""The server's input transcription as sessions see it: the model names they may ask for, and
one call that recognises an item's audio off the event loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from duplex.media.rates import ASR_RATE

from .recognizer import Hints, Recognizer
from .registry import RecognizerRegistry
from .service import (
    RECOGNITION_FAILED,
    Callback,
    TranscriptionError,
    TranscriptionResult,
    TranscriptionService,
)


class Transcriber:
    def __init__(self, configured: str, max_queue: int = 64) -> None:
        self.registry = RecognizerRegistry(configured)
        self.service = TranscriptionService(max_queue=max_queue)
        # A client may name the configured checkpoint, never another directory: paths sent
        # over the wire would let any client make the server load whatever it can read.
        own = [configured] if Path(configured).expanduser().is_dir() else []
        self._own = tuple(own)
        self.names = tuple(dict.fromkeys([*self.registry.names(), *own]))

    def recognizer(self, model: str) -> Recognizer:
        """What a session's `model` name selects (never an error: see `for_session`)."""
        return self.registry.for_session(model, self._own)

    def languages(self, model: str) -> tuple[str, ...] | None:
        """The languages the recogniser `model` selects transcribes; None: any it is told."""
        return self.recognizer(model).languages()

    def submit(self, model: str, pcm: np.ndarray, callback: Callback,
               hints: Hints | None = None) -> None:
        """Recognise `pcm` (float32, 16 kHz) with `model`, told `hints`; `callback` gets the
        result, once."""
        try:
            recognizer = self.recognizer(model)
        except ValueError as exc:
            callback(TranscriptionResult("", model, len(pcm) / ASR_RATE,
                                         TranscriptionError(RECOGNITION_FAILED, str(exc))))
            return
        self.service.submit(recognizer, pcm, callback, hints or Hints())

    def stop(self) -> None:
        self.service.stop()
