"""The model's context as the listener heard it: what a node needs to rebuild it after a resume.

A session records what it hands the engine in the order it hands it: the system turn that opened
the context, user audio at the model's input rate, text turns (text items, tool outputs) and
each reply as the token ids the listener heard (a reply cut by a barge-in or a dropped
connection keeps only the tokens whose audio had started playing). Another node replays it
through the ordinary engine calls, so the audio is re-encoded and everything is re-prefilled in
the normal batched stages, in order, before any later reply can begin.

User audio is 16-bit PCM: the session quantises what it pushes to the engine onto that grid, so
the model hears the very samples the record keeps, and FLAC (through PyAV) stores them
losslessly, in blocks of `BLOCK_S`. Past `max_bytes` the oldest entries (and the oldest blocks
of a long audio entry) are left out of the saved record, as the Thinker's own truncation drops
the oldest context first; the system turn always stays.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.media.fir import InputResamplers, ResamplerState

FLAC = "flac"
Heard = Callable[[int], int | None]
"""Samples heard (at the reply's output rate) of the reply with this core id; None: all."""


def quantize(pcm: np.ndarray) -> np.ndarray:
    """Float32 onto the 16-bit grid the record stores: what the model hears is what is kept."""
    return from_pcm16(np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16))


def from_pcm16(pcm16: np.ndarray) -> np.ndarray:
    """The float32 samples `quantize` made, bit for bit."""
    return pcm16.astype(np.float32) / np.float32(32767.0)


def encode_flac(pcm16: np.ndarray, rate: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=FLAC) as container:
        stream = container.add_stream(FLAC, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(pcm16.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def decode_flac(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data), "r", format=FLAC) as container:
        parts = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
    return np.concatenate(parts).astype(np.int16) if parts else np.zeros(0, np.int16)


BLOCK_S = 10
"""Audio is encoded in blocks of this many seconds, each once: a save re-encodes only the last."""


@dataclass
class AudioSpan:
    pcm16: list[np.ndarray] = field(default_factory=list)
    """Samples not yet in a full block."""
    blocks: list[tuple[int, str]] = field(default_factory=list)
    """(samples, base64 FLAC) of each full block."""
    _tail: tuple[int, str] | None = None
    """The last encoding of `pcm16`, reused while no audio was added."""

    @property
    def samples(self) -> int:
        return sum(n for n, _ in self.blocks) + sum(len(p) for p in self.pcm16)

    def add(self, pcm16: np.ndarray, rate: int) -> None:
        self.pcm16.append(pcm16)
        n = BLOCK_S * rate
        if sum(len(p) for p in self.pcm16) >= n:
            pcm = np.concatenate(self.pcm16)
            while len(pcm) >= n:
                self.blocks.append((n, base64.b64encode(encode_flac(pcm[:n], rate)).decode()))
                pcm = pcm[n:]
            self.pcm16 = [pcm]

    def blobs(self, rate: int) -> list[tuple[int, str]]:
        """(samples, base64 FLAC) of every block, the samples not yet in one last."""
        tail = sum(len(p) for p in self.pcm16)
        if tail and (self._tail is None or self._tail[0] != tail):
            pcm = np.concatenate(self.pcm16)
            self.pcm16 = [pcm]
            self._tail = (tail, base64.b64encode(encode_flac(pcm, rate)).decode())
        return self.blocks + ([self._tail] if tail else [])

    def pcm(self) -> np.ndarray:
        """Every sample, in order (decoded from the blocks)."""
        parts = [decode_flac(base64.b64decode(b)) for _, b in self.blocks] + self.pcm16
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)


@dataclass
class TextSpan:
    text: str
    role: str


@dataclass
class ReplySpan:
    core_id: int | None
    """The reply in this session's core (how much of it was heard); None once cut for good."""
    epoch: int
    instructions: str
    tools: tuple[dict[str, Any], ...]
    tokens: list[tuple[int, int | None, tuple[int, ...]]] = field(default_factory=list)
    """(place in the reply, where their audio starts in it, ids); None: never voiced."""

    def heard_ids(self, heard: int | None, scale: float) -> list[int]:
        """The reply's tokens in order, up to the first whose audio had not started."""
        ids: list[int] = []
        for place, start, part in sorted(self.tokens):
            if place != len(ids) or (heard is not None and start is not None
                                     and start * scale >= heard):
                break
            ids += part
        return ids


Span = AudioSpan | TextSpan | ReplySpan


@dataclass(frozen=True)
class Rebuilt:
    """How much context a resume put back (told to the client in session.resumed)."""

    items: int
    audio_seconds: float
    left_out: int
    """Oldest turns the byte cap had left out of the record."""
    kept_live: bool = False

    def wire(self) -> dict[str, Any]:
        return {"items": self.items, "audio_seconds": round(self.audio_seconds, 3),
                "left_out_items": self.left_out, "kept_live": self.kept_live}


class ContextRecord:
    def __init__(self, input_rate: int, output_rate: int, session_rate: int,
                 max_bytes: int) -> None:
        self.input_rate = input_rate
        self.scale = session_rate / output_rate
        """Reply output samples -> session clock samples (where heard samples are counted)."""
        self.max_bytes = max_bytes
        self.head: tuple[str, tuple[dict[str, Any], ...]] | None = None
        self.spans: list[Span] = []
        self.left_out = 0
        self.resamplers: InputResamplers | None = None
        """Where the input path's resamplers stood when the record was saved: a new connection
        goes on from there, so new audio reaches the model as it would have without the drop."""

    # -- what the session hands the engine, in order -----------------------------------------

    def instruct(self, instructions: str, tools: tuple[dict[str, Any], ...]) -> None:
        """Only the system turn that opens the context matters: later ones enter the context
        with the next reply (its spec), as the model places them."""
        if not self.spans:
            self.head = (instructions, tuple(tools))

    def audio(self, pcm: np.ndarray) -> None:
        """Float32 at the model's input rate, already `quantize`d."""
        if not (self.spans and isinstance(self.spans[-1], AudioSpan)):
            self.spans.append(AudioSpan())
        self.spans[-1].add(np.round(pcm * 32767.0).astype(np.int16), self.input_rate)

    def text(self, text: str, role: str) -> None:
        self.spans.append(TextSpan(text, role))

    def reply(self, core_id: int, epoch: int, instructions: str,
              tools: tuple[dict[str, Any], ...]) -> None:
        self.spans.append(ReplySpan(core_id, epoch, instructions, tuple(tools)))

    def tokens(self, epoch: int, ids: tuple[int, ...], media_start: int | None,
               place: int) -> None:
        """Reply tokens from the engine (`ReplyTokens`), the first the reply's `place`-th."""
        last = next((s for s in reversed(self.spans) if isinstance(s, ReplySpan)), None)
        if last is not None and last.epoch == epoch and last.core_id is not None:
            last.tokens.append((place, media_start, tuple(ids)))

    def clear_input(self) -> None:
        """The user cleared the input buffer: the audio since the last turn is gone."""
        if self.spans and isinstance(self.spans[-1], AudioSpan):
            self.spans.pop()

    # -- saved and loaded ---------------------------------------------------------------------

    def to_record(self, heard: Heard,
                  resamplers: InputResamplers | None = None) -> dict[str, Any]:
        """Plain JSON for the registry: replies cut at what was heard, audio as FLAC, the
        oldest turns left out past `max_bytes`, and where the input `resamplers` stand."""
        entries: list[dict[str, Any]] = []
        for span in self.spans:
            if isinstance(span, AudioSpan):
                blobs = span.blobs(self.input_rate)
                entries.append({"audio": [b for _, b in blobs], "samples": [n for n, _ in blobs]})
            elif isinstance(span, TextSpan):
                entries.append({"text": span.text, "role": span.role})
            else:
                h = heard(span.core_id) if span.core_id is not None else None
                entries.append({"reply": span.heard_ids(h, self.scale),
                                "instructions": span.instructions, "tools": list(span.tools)})
        size = sum(_size(e) for e in entries)
        left_out = self.left_out
        while entries and size > self.max_bytes:
            first = entries[0]
            if len(first.get("audio", ())) > 1:
                # One long stretch of audio (a long silence under server VAD) loses its
                # oldest block, not all of it.
                size -= len(first["audio"][0])
                first["audio"], first["samples"] = first["audio"][1:], first["samples"][1:]
                continue
            size -= _size(entries.pop(0))
            left_out += 1
        head = None if self.head is None else {"instructions": self.head[0],
                                               "tools": list(self.head[1])}
        saved = {"rate": self.input_rate, "head": head, "entries": entries,
                 "left_out": left_out}
        if resamplers is not None:
            saved["resampler"] = _state_json(resamplers.model)
            if resamplers.g711 is not None:
                saved["g711_resampler"] = _state_json(resamplers.g711)
        return saved

    @classmethod
    def from_record(cls, data: dict[str, Any], input_rate: int, output_rate: int,
                    session_rate: int, max_bytes: int) -> ContextRecord:
        """A record saved by `to_record` (replies already cut) to go on recording into."""
        record = cls(input_rate, output_rate, session_rate, max_bytes)
        if not data or data.get("rate") != input_rate:
            return record
        head = data.get("head")
        if head is not None:
            record.head = (head["instructions"], tuple(head["tools"]))
        record.left_out = data.get("left_out", 0)
        if (r := data.get("resampler")) is not None:
            g711 = data.get("g711_resampler")
            record.resamplers = InputResamplers(_state_from_json(r),
                                                None if g711 is None else _state_from_json(g711))
        for e in data.get("entries", []):
            if "audio" in e:
                record.spans.append(AudioSpan(blocks=list(zip(e["samples"], e["audio"],
                                                              strict=True))))
            elif "text" in e:
                record.spans.append(TextSpan(e["text"], e["role"]))
            else:
                span = ReplySpan(None, -1, e["instructions"], tuple(e["tools"]))
                span.tokens = [(0, None, tuple(e["reply"]))]
                record.spans.append(span)
        return record

    def summary(self, kept_live: bool = False) -> Rebuilt:
        items = sum(1 for s in self.spans if not isinstance(s, ReplySpan) or s.tokens)
        samples = sum(s.samples for s in self.spans if isinstance(s, AudioSpan))
        return Rebuilt(items, samples / self.input_rate, self.left_out, kept_live)


def _state_json(state: ResamplerState) -> dict[str, Any]:
    return {"fed": state.fed, "emitted": state.emitted,
            "tail": base64.b64encode(state.tail.astype("<f4").tobytes()).decode()}


def _state_from_json(data: dict[str, Any]) -> ResamplerState:
    tail = np.frombuffer(base64.b64decode(data["tail"]), "<f4").astype(np.float32)
    return ResamplerState(tail, data["fed"], data["emitted"])


def _size(entry: dict[str, Any]) -> int:
    """Bytes an entry takes in the record, near enough (a token id as 8)."""
    return (sum(len(b) for b in entry.get("audio", ())) + 8 * len(entry.get("reply", ()))
            + len(entry.get("text", "")))
