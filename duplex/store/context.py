"""The model's context as the listener heard it: what a node needs to rebuild it after a resume.

A session records what it hands the engine in the order it hands it: the system turn that opened
the context, user audio at the model's input rate, text turns (text items, tool outputs, system
and assistant messages, function calls), where each conversation item's part starts (its unit:
an edit of the conversation rewinds the record with the model and lays the units after the
edit again from here) and each reply as the token ids the listener heard (a reply cut by a barge-in or a dropped
connection keeps only the tokens whose audio had started playing). Another node replays it
through the ordinary engine calls, so the audio is re-encoded and everything is re-prefilled in
the normal batched stages, in order, before any later reply can begin.

User audio is 16-bit PCM: the session quantises what it pushes to the engine onto that grid, so
the model hears the very samples the record keeps, and FLAC (through PyAV) stores them
losslessly, in blocks of `BLOCK_S`. Past `max_bytes` the oldest entries (and the oldest blocks
of a long audio entry) are left out of the saved record, as the Thinker's own truncation drops
the oldest context first; the system turn always stays.

The registry keeps it as parts that never change once named (a block of audio, a text turn, a
reply as heard so far, the system turn) and a small index that lists them: a save writes the
index and the parts new since the last save (the audio that came since, as one more piece
until a block is full), so what it writes stays small however long the call
(`duplex.store.base.StoredContext`).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from duplex.media.fir import InputResamplers, ResamplerState
from duplex.store.base import StoredContext

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
    # No 8 kB of header padding (room for tags added later) in every block.
    with av.open(buf, "w", format=FLAC, options={"metadata_header_padding": "0"}) as container:
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
"""Audio is encoded in blocks of this many seconds, each once."""


class Part(NamedTuple):
    """A piece of the saved context under its own name in the registry."""

    name: str
    text: str
    size: int
    """What it counts against the byte cap."""


@dataclass(frozen=True)
class Block:
    """Encoded audio: never changes once it has a name."""

    name: str
    samples: int
    flac: str
    """Base64 FLAC."""

    def part(self) -> Part:
        return Part(self.name, f"{self.samples}:{self.flac}", len(self.flac))

    @classmethod
    def of(cls, name: str, text: str) -> Block:
        samples, _, flac = text.partition(":")
        return cls(name, int(samples), flac)


def _block(name: str, pcm16: np.ndarray, rate: int) -> Block:
    return Block(name, len(pcm16), base64.b64encode(encode_flac(pcm16, rate)).decode())


@dataclass
class AudioSpan:
    blocks: list[Block] = field(default_factory=list)
    """Full blocks (and, in a loaded record, every piece saved)."""
    pcm16: list[np.ndarray] = field(default_factory=list)
    """Samples not yet in a full block."""
    pieces: list[Block] = field(default_factory=list)
    """`pcm16` as saved so far: a save encodes only what came since the one before, so what a
    save writes is the new audio, not the growing block."""

    @property
    def samples(self) -> int:
        return sum(b.samples for b in self.blocks) + sum(len(p) for p in self.pcm16)

    def add(self, pcm16: np.ndarray, rate: int, name: Callable[[], str]) -> None:
        self.pcm16.append(pcm16)
        n = BLOCK_S * rate
        if sum(len(p) for p in self.pcm16) >= n:
            pcm = np.concatenate(self.pcm16)
            while len(pcm) >= n:
                self.blocks.append(_block(name(), pcm[:n], rate))
                pcm = pcm[n:]
            self.pcm16 = [pcm]
            # The block holds what the pieces did; the samples past it are saved anew.
            self.pieces = []

    def saved(self, rate: int, name: Callable[[], str]) -> list[Block]:
        """Every block, then the pieces of the samples not yet in one (the samples that came
        since the last call encoded as one more)."""
        done = sum(b.samples for b in self.pieces)
        if sum(len(p) for p in self.pcm16) > done:
            pcm = np.concatenate(self.pcm16)
            self.pcm16 = [pcm]
            self.pieces.append(_block(name(), pcm[done:], rate))
        return self.blocks + self.pieces

    def pcm(self) -> np.ndarray:
        """Every sample, in order (decoded from the blocks)."""
        parts = [decode_flac(base64.b64decode(b.flac)) for b in self.blocks] + self.pcm16
        return np.concatenate(parts) if parts else np.zeros(0, np.int16)


@dataclass
class TextSpan:
    text: str
    role: str
    name: str

    def part(self) -> Part:
        return Part(self.name, json.dumps({"text": self.text, "role": self.role}), len(self.text))


@dataclass
class ReplySpan:
    core_id: int | None
    """The reply in this session's core (how much of it was heard); None once cut for good."""
    epoch: int
    instructions: str
    tools: tuple[dict[str, Any], ...]
    tokens: list[tuple[int, int | None, tuple[int, ...]]] = field(default_factory=list)
    """(place in the reply, where their audio starts in it, ids); None: never voiced."""
    saved: tuple[list[int], Part] | None = None
    """The ids last saved and their part."""
    speed: Fraction = Fraction(1)
    """The speed it was voiced at (audio.output.speed): a token's audio that starts at
    `start` of the reply reaches the listener at `start / speed`."""

    def heard_ids(self, heard: int | None, scale: float) -> list[int]:
        """The reply's tokens in order, up to the first whose audio had not started."""
        ids: list[int] = []
        for place, start, part in sorted(self.tokens):
            if place != len(ids) or (heard is not None and start is not None
                                     and start * scale >= heard * self.speed):
                break
            ids += part
        return ids

    def part(self, ids: list[int], name: Callable[[], str]) -> Part:
        """The reply as heard (`ids`); named anew whenever more of it was."""
        if self.saved is None or self.saved[0] != ids:
            text = json.dumps({"reply": ids, "instructions": self.instructions,
                               "tools": list(self.tools)})
            self.saved = (ids, Part(name(), text, 8 * len(ids)))
        return self.saved[1]


@dataclass
class MarkSpan:
    """Where a conversation item's part of the context (its unit) starts."""

    key: int


@dataclass
class ImageSpan:
    """An image the user sent: kept to lay it again after an edit, not saved (a resume puts
    back the conversation's words and sounds, not its pictures)."""

    data: bytes


Span = AudioSpan | TextSpan | ReplySpan | MarkSpan | ImageSpan
_UNSAVED = (MarkSpan, ImageSpan)


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
        self._head_part: Part | None = None
        self.spans: list[Span] = []
        self.left_out = 0
        self.resamplers: InputResamplers | None = None
        """Where the input path's resamplers stood when the record was saved: a new connection
        goes on from there, so new audio reaches the model as it would have without the drop."""
        self._named = 0
        """Parts named so far in this session (saved with the index, so a resume on another
        node goes on naming where this one stopped and never reuses a name)."""

    def _name(self) -> str:
        self._named += 1
        return format(self._named, "x")

    # -- what the session hands the engine, in order -----------------------------------------

    def instruct(self, instructions: str, tools: tuple[dict[str, Any], ...]) -> None:
        """Only the system turn that opens the context matters: later ones enter the context
        with the next reply (its spec), as the model places them."""
        held = any(not isinstance(span, MarkSpan) for span in self.spans)
        if not held and self.head != (instructions, tuple(tools)):
            self.head = (instructions, tuple(tools))
            self._head_part = Part(self._name(), json.dumps(
                {"instructions": instructions, "tools": list(tools)}), 0)

    def audio(self, pcm: np.ndarray) -> None:
        """Float32 at the model's input rate, already `quantize`d."""
        if not (self.spans and isinstance(self.spans[-1], AudioSpan)):
            self.spans.append(AudioSpan())
        self.spans[-1].add(np.round(pcm * 32767.0).astype(np.int16), self.input_rate, self._name)

    def text(self, text: str, role: str) -> None:
        self.spans.append(TextSpan(text, role, self._name()))

    def reply(self, core_id: int, epoch: int, instructions: str,
              tools: tuple[dict[str, Any], ...], speed: Fraction = Fraction(1)) -> None:
        self.spans.append(ReplySpan(core_id, epoch, instructions, tuple(tools), speed=speed))

    def tokens(self, epoch: int, ids: tuple[int, ...], media_start: int | None,
               place: int) -> None:
        """Reply tokens from the engine (`ReplyTokens`), the first the reply's `place`-th."""
        last = next((s for s in reversed(self.spans) if isinstance(s, ReplySpan)), None)
        if last is not None and last.epoch == epoch and last.core_id is not None:
            last.tokens.append((place, media_start, tuple(ids)))

    def mark(self, key: int) -> None:
        self.spans.append(MarkSpan(key))

    def image(self, data: bytes) -> None:
        self.spans.append(ImageSpan(data))

    def rewind(self, key: int) -> dict[int, list[Span]]:
        """Take out the unit `key` and every span after it, as the model forgets them; returns
        what each unit taken out held, to lay it again. A unit the byte cap left out takes
        everything still here with it."""
        at = next((i for i in range(len(self.spans) - 1, -1, -1)
                   if isinstance(self.spans[i], MarkSpan) and self.spans[i].key == key), 0)
        cut, self.spans = self.spans[at:], self.spans[:at]
        units: dict[int, list[Span]] = {}
        current: list[Span] | None = None
        for span in cut:
            if isinstance(span, MarkSpan):
                current = units.setdefault(span.key, [])
            elif current is not None:
                current.append(span)
        return units

    def replayed_reply(self, span: ReplySpan, ids: list[int]) -> None:
        """A reply laid again as heard: it holds those ids from now on."""
        again = ReplySpan(None, -1, span.instructions, span.tools)
        again.tokens = [(0, None, tuple(ids))] if ids else []
        self.spans.append(again)

    def units(self) -> list[int]:
        return [span.key for span in self.spans if isinstance(span, MarkSpan)]

    def clear_input(self) -> None:
        """The user cleared the input buffer: the audio since the last turn is gone."""
        if self.spans and isinstance(self.spans[-1], AudioSpan):
            self.spans.pop()

    # -- saved and loaded ---------------------------------------------------------------------

    def to_record(self, heard: Heard,
                  resamplers: InputResamplers | None = None) -> StoredContext:
        """The context for the registry: replies cut at what was heard, audio as FLAC, the
        oldest turns left out past `max_bytes`, and where the input `resamplers` stand.
        Its index is small JSON naming the parts in order; a part keeps its name (and the
        registry its copy) while it is unchanged, so a save writes the index and the parts
        new since the last."""
        entries: list[tuple[Span, str, list[Part]]] = []
        for span in self.spans:
            if isinstance(span, _UNSAVED):
                continue
            if isinstance(span, AudioSpan):
                blocks = span.saved(self.input_rate, self._name)
                entries.append((span, "audio", [b.part() for b in blocks]))
            elif isinstance(span, TextSpan):
                entries.append((span, "text", [span.part()]))
            else:
                h = heard(span.core_id) if span.core_id is not None else None
                entries.append((span, "reply",
                                [span.part(span.heard_ids(h, self.scale), self._name)]))
        size = sum(p.size for _, _, parts in entries for p in parts)
        # What the cap leaves out is let go here too: left out now, it would be left out of
        # every later save, and a long call's record would otherwise hold all its audio for
        # as long as the call lasts.
        while entries and size > self.max_bytes:
            span, _, parts = entries[0]
            if len(parts) > 1:
                # One long stretch of audio (a long silence under server VAD) loses its
                # oldest block, not all of it.
                size -= parts.pop(0).size
                if isinstance(span, AudioSpan) and span.blocks:
                    span.blocks.pop(0)
                continue
            size -= sum(p.size for p in entries.pop(0)[2])
            # The span goes, with the marks and images before it.
            del self.spans[: next(i for i, s in enumerate(self.spans) if s is span) + 1]
            self.left_out += 1
        units, saved = [], 0
        for span in self.spans:
            if isinstance(span, MarkSpan):
                units.append([saved, span.key])
            elif not isinstance(span, ImageSpan):
                saved += 1
        kept = [p for _, _, parts in entries for p in parts]
        if self._head_part is not None:
            kept.append(self._head_part)
        index: dict[str, Any] = {
            # Not "rate": a node of the release before this format reads a record with its
            # rate under that key, and crashes on this index; one without it it takes for
            # another model's and resumes without the context.
            "input_rate": self.input_rate, "named": self._named,
            "head": self._head_part.name if self._head_part is not None else None,
            "entries": [{kind: [p.name for p in parts]} for _, kind, parts in entries],
            "left_out": self.left_out, "units": units}
        if resamplers is not None:
            index["resampler"] = _state_json(resamplers.model)
            if resamplers.g711 is not None:
                index["g711_resampler"] = _state_json(resamplers.g711)
        parts = {p.name: p.text for p in kept}
        return StoredContext(index, parts, tuple(parts))

    @classmethod
    def from_record(cls, stored: StoredContext, input_rate: int, output_rate: int,
                    session_rate: int, max_bytes: int) -> ContextRecord:
        """A context saved by `to_record` (replies already cut) to go on recording into."""
        record = cls(input_rate, output_rate, session_rate, max_bytes)
        index, parts = stored.index, stored.parts
        # Even a record this model cannot use keeps its names: the registry holds parts under
        # them, and a new part must never be taken for one of those.
        record._named = index.get("named", 0)
        if index.get("input_rate", index.get("rate")) != input_rate:
            return record
        if "named" not in index:
            record._load_whole(index)
            return record
        if (name := index["head"]) is not None:
            head = json.loads(parts[name])
            record.head = (head["instructions"], tuple(head["tools"]))
            record._head_part = Part(name, parts[name], 0)
        record.left_out = index["left_out"]
        if (r := index.get("resampler")) is not None:
            g711 = index.get("g711_resampler")
            record.resamplers = InputResamplers(_state_from_json(r),
                                                None if g711 is None else _state_from_json(g711))
        marks = index.get("units", [])
        for at, entry in enumerate(index["entries"]):
            record.spans += [MarkSpan(key) for place, key in marks if place == at]
            [(kind, names)] = entry.items()
            if kind == "audio":
                record.spans.append(AudioSpan(blocks=[Block.of(n, parts[n]) for n in names]))
                continue
            [name] = names
            e = json.loads(parts[name])
            if kind == "text":
                record.spans.append(TextSpan(e["text"], e["role"], name))
            else:
                span = ReplySpan(None, -1, e["instructions"], tuple(e["tools"]))
                ids = e["reply"]
                span.tokens = [(0, None, tuple(ids))] if ids else []
                span.saved = (ids, Part(name, parts[name], 8 * len(ids)))
                record.spans.append(span)
        record.spans += [MarkSpan(key) for place, key in marks if place == len(index["entries"])]
        return record

    def _load_whole(self, data: dict[str, Any]) -> None:
        """A record of the whole-record format (the release before incremental saves, whose
        nodes kept the entire context in the session's `context` field): read, so a session a
        node of that release saved resumes with its context here. Its parts are named anew;
        the registry holds none of them, so the first save writes them all."""
        if (head := data.get("head")) is not None:
            self.instruct(head["instructions"], tuple(head["tools"]))
        self.left_out = data.get("left_out", 0)
        if (r := data.get("resampler")) is not None:
            self.resamplers = InputResamplers(_state_from_json(r), None)
        for e in data.get("entries", []):
            if "audio" in e:
                self.spans.append(AudioSpan(blocks=[
                    Block(self._name(), n, flac)
                    for n, flac in zip(e["samples"], e["audio"], strict=True)]))
            elif "text" in e:
                self.text(e["text"], e["role"])
            else:
                span = ReplySpan(None, -1, e["instructions"], tuple(e["tools"]))
                span.tokens = [(0, None, tuple(e["reply"]))] if e["reply"] else []
                self.spans.append(span)

    def summary(self, kept_live: bool = False) -> Rebuilt:
        items = sum(1 for s in self.spans if not isinstance(s, (*_UNSAVED, ReplySpan))
                    or isinstance(s, ReplySpan) and s.tokens)
        samples = sum(s.samples for s in self.spans if isinstance(s, AudioSpan))
        return Rebuilt(items, samples / self.input_rate, self.left_out, kept_live)


def _state_json(state: ResamplerState) -> dict[str, Any]:
    return {"fed": state.fed, "emitted": state.emitted,
            "tail": base64.b64encode(state.tail.astype("<f4").tobytes()).decode()}


def _state_from_json(data: dict[str, Any]) -> ResamplerState:
    tail = np.frombuffer(base64.b64decode(data["tail"]), "<f4").astype(np.float32)
    return ResamplerState(tail, data["fed"], data["emitted"])
