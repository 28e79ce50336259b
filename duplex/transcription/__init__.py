"""Speech recognition for input audio transcription.

Importing this package loads no model and no torch: recognisers load on first use, on the
transcription worker thread.
"""

from .recognizer import Hints, Recognizer
from .registry import OPENAI_NAMES, RecognizerRegistry, UnknownModelError
from .service import (
    INVALID_AUDIO,
    QUEUE_FULL,
    RECOGNITION_FAILED,
    STOPPED,
    TranscriptionError,
    TranscriptionResult,
    TranscriptionService,
)
from .transcriber import Transcriber
from .whisper import (
    EMBEDDED_NAME,
    CTranslate2Whisper,
    TransformersWhisper,
    WhisperRecognizer,
    embedded_whisper,
    load_checkpoint,
)

__all__ = [
    "EMBEDDED_NAME",
    "Hints",
    "INVALID_AUDIO",
    "OPENAI_NAMES",
    "QUEUE_FULL",
    "RECOGNITION_FAILED",
    "STOPPED",
    "CTranslate2Whisper",
    "Recognizer",
    "RecognizerRegistry",
    "TranscriptionError",
    "TranscriptionResult",
    "TranscriptionService",
    "Transcriber",
    "TransformersWhisper",
    "UnknownModelError",
    "WhisperRecognizer",
    "embedded_whisper",
    "load_checkpoint",
]
