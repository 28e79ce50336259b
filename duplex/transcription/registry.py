"""The transcription model names a client may send, and the recogniser each one means."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from .recognizer import Recognizer
from .whisper import EMBEDDED_NAME, embedded_whisper, load_checkpoint

# OpenAI's transcription models (the GA SDK's list): clients written for OpenAI send these, and
# get whatever this server is configured to recognise with.
OPENAI_NAMES = ("whisper-1", "gpt-transcribe", "gpt-live-transcribe", "gpt-4o-mini-transcribe",
                "gpt-4o-mini-transcribe-2025-12-15", "gpt-4o-transcribe",
                "gpt-4o-transcribe-diarize", "gpt-realtime-whisper")

PATH_HINT = "or the path of a local checkpoint directory"


class UnknownModelError(ValueError):
    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        self.available = available
        super().__init__(
            f"unknown transcription model {name!r}; available: {', '.join(available)}, {PATH_HINT}"
        )


class RecognizerRegistry:
    """Resolves model names to recognisers, one instance per name or directory.

    `configured` is the name of a built-in recogniser or a checkpoint directory; it answers
    the OpenAI names. It resolves at construction, so a bad setting fails at start-up rather
    than at a session's first transcription. Models still load on first use.
    """

    def __init__(
        self,
        configured: str = EMBEDDED_NAME,
        builtins: Mapping[str, Callable[[], Recognizer]] | None = None,
    ) -> None:
        if builtins is None:
            builtins = {EMBEDDED_NAME: embedded_whisper}
        self._builtins = dict(builtins)
        self._instances: dict[str, Recognizer] = {}
        self._lock = threading.Lock()
        if configured in OPENAI_NAMES:
            raise ValueError(
                f"{configured!r} names the configured recogniser; configure a real one"
            )
        self.configured = self.resolve(configured)

    def names(self) -> list[str]:
        return [*OPENAI_NAMES, *self._builtins]

    def for_session(self, name: str, own: tuple[str, ...] = ()) -> Recognizer:
        """The recogniser a session's model name selects: a built-in one or the configured
        checkpoint (`own`) by its name; any other name, OpenAI's included, the configured
        one, so that no client's choice of name fails its session."""
        if name in self._builtins or name in own:
            return self.resolve(name)
        return self.configured

    def resolve(self, name: str) -> Recognizer:
        """The recogniser for `name`; ValueError (UnknownModelError for a name that is neither
        known nor a directory) when there is none."""
        if name in OPENAI_NAMES:
            return self.configured
        with self._lock:
            if name in self._builtins:
                if name not in self._instances:
                    self._instances[name] = self._builtins[name]()
                return self._instances[name]
            path = Path(name).expanduser()
            if not path.is_dir():
                raise UnknownModelError(name, self.names())
            key = str(path.resolve())
            if key not in self._instances:
                self._instances[key] = load_checkpoint(key)
            return self._instances[key]
