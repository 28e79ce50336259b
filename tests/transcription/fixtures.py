"""Test material made on the spot: English utterances spoken by espeak-ng, and a tiny
random-weight Whisper checkpoint with a tokenizer built from nothing but its alphabet.

The texts are those the bench's callers say (duplex.bench.speech); the tests speak them afresh,
lead-in silence and all, and commit nothing binary. `python -m tests.transcription.fixtures DIR`
writes the utterances as WAV files with their texts in DIR/texts.tsv, to listen to them.
"""

from __future__ import annotations

import shutil
import sys
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr

from duplex.bench.speech import TEXTS, VOICE, WORDS_PER_MINUTE, espeak

RATE = 16000


@dataclass(frozen=True)
class Utterance:
    name: str
    text: str
    pcm: np.ndarray
    path: Path


def have_espeak() -> bool:
    return shutil.which("espeak-ng") is not None


def speak(text: str, voice: str = VOICE, words_per_minute: int = WORDS_PER_MINUTE) -> np.ndarray:
    """espeak-ng's speech for `text`, as 16 kHz float32 mono."""
    pcm, rate = espeak(text, voice, words_per_minute)
    return soxr.resample(pcm, rate, RATE).astype(np.float32)


def write_wav(path: Path, pcm: np.ndarray) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype(np.int16).tobytes())


def make_utterances(directory: Path) -> list[Utterance]:
    directory.mkdir(parents=True, exist_ok=True)
    utterances = []
    for i, text in enumerate(TEXTS):
        pcm = speak(text)
        path = directory / f"utterance{i}.wav"
        write_wav(path, pcm)
        utterances.append(Utterance(path.stem, text, pcm, path))
    (directory / "texts.tsv").write_text("".join(f"{u.path.name}\t{u.text}\n" for u in utterances))
    return utterances


SPECIAL_TOKENS = ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>")


def build_tiny_whisper(directory: Path) -> Path:
    """A Whisper checkpoint of random weights, a few hundred kB, saved as from_pretrained reads it.

    Its tokenizer is byte-level BPE over the 256 byte symbols with no merges, so it needs no
    vocabulary file from anywhere: every text still encodes and any ids decode.
    """
    import torch
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    vocab = {symbol: i for i, symbol in enumerate(sorted(ByteLevel.alphabet()))}
    eot = SPECIAL_TOKENS[0]
    tokenizer = WhisperTokenizer(
        vocab, [], unk_token=eot, bos_token=eot, eos_token=eot, pad_token=eot
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    eot_id, sot_id, _ = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_target_positions=64,
        pad_token_id=eot_id,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        decoder_start_token_id=sot_id,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=sot_id, eos_token_id=eot_id, pad_token_id=eot_id, max_length=16
    )
    model.save_pretrained(directory)
    WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer
    ).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    for u in make_utterances(Path(sys.argv[1])):
        print(f"{u.path}\t{len(u.pcm) / RATE:.2f} s\t{u.text}")
