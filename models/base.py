"""The one interface every duplex model family implements.

The engine drives a model through five batched stage calls. Each takes a list of per-session
states (one per session in the batch, all distinct) and a list of inputs in the same order, runs
ONE forward for the whole batch, and returns outputs in the same order. Per-session neural state
(KV caches, codec carry state) lives in the `ModelState` the adapter hands out, one `SlotState`
per named slot, so the engine can release it on an epoch bump or close and ask how many bytes it
holds.

Stage order for a Thinker-Talker turn:
  encode_audio (user PCM chunks -> features) -> thinker_prefill (features into the Thinker KV)
  on a response: thinker_decode (one text token per call) -> talker_step (one codec frame of
  Q codebooks per call) -> codec_decode (codes -> PCM, streaming, carried state).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from models.caches import CacheStats
from models.reply import ReplySpec


class SlotState(Protocol):
    """One part of a session's state: what it holds, and how to give it back."""

    @property
    def nbytes(self) -> int: ...

    def release(self) -> None:
        """Give back every buffer and pool row it holds; `nbytes` is 0 afterwards."""


@dataclass
class ModelState:
    """Per-session state an adapter keeps, by slot name; `bytes_held` sums the slots."""

    session_id: str
    slots: dict[str, SlotState] = field(default_factory=dict)


@dataclass(frozen=True)
class TextTurn:
    """Text for the Thinker's context: the user's words, the output of a tool it called, or
    a turn of its own: a system message, an assistant message, a function call as the model
    writes one."""

    text: str
    role: str = "user"
    """user | tool | system | assistant | function_call (`text` is then the call as JSON:
    {"name": ..., "arguments": "<JSON string>"})"""


@dataclass(frozen=True)
class Mark:
    """A boundary between conversation items in the Thinker's context: the turn open there
    ends, and `Rewind(key)` can bring the context back to this point."""

    key: int


@dataclass(frozen=True)
class Rewind:
    """Bring the Thinker's context back to where `Mark(key)` was laid, dropping everything
    after it (that mark and later ones too): the positions before it keep their KV."""

    key: int
    system: tuple[str, tuple[dict[str, Any], ...]] | None = None
    """The session's instructions and tools, for a context rewound to its head: they open it
    again (as `instruct` does a new one)."""


@dataclass(frozen=True)
class ThinkerToken:
    """One Thinker decode result: the text piece, what the Talker conditions on, and EOS."""

    text: str
    conditioning: Any
    finished: bool
    token_id: int | None = None
    """The token itself, for models whose context a resume rebuilds (None: the model has none)."""
    usage: dict[str, Any] | None = None
    """With a reply's first token: what its context held (input and cached positions, what
    truncation dropped); `reason` ends a reply that could not run."""
    reason: str | None = None


@dataclass(frozen=True)
class ReplyTurn:
    """A reply put back into the Thinker's context as it was heard (a resume on another node):
    the assistant turn holds exactly `ids`, under the system turn that reply ran with."""

    ids: tuple[int, ...]
    instructions: str = ""
    tools: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class KVStats:
    """One stage's paged KV pool (`models.paged_kv`) as the engine reports it."""

    blocks_total: int
    blocks_used: int
    """Blocks holding positions: sessions' own and the prefix cache's (shared ones once)."""
    block_bytes: int
    blocks_free: int
    """Blocks a new session or reply may still take: free ones and those the prefix cache
    would give up, less what replies in progress have reserved."""
    session_blocks: int
    """Blocks one more session needs: its head and its first reply."""
    sessions_admissible: int
    """Sessions that may still open before memory runs short (none when refusing)."""
    needed_bytes: int
    """What the live contexts need: their positions times the bytes of a position."""
    slot_pool_bytes: int
    """What the slot layout (a row per session, every row as long as the longest, rows and
    length rounded up as it grew them) would hold for the same contexts: at least this."""


@dataclass(frozen=True)
class TalkerFrame:
    """One Talker step: codes of shape (Q,) for one codec frame, or None when it produced none."""

    codes: Any
    finished: bool


@dataclass(frozen=True)
class OfflineCodec:
    """A codec's own whole-signal decoder: the reference the bench measures `codec_decode`'s
    streaming against, for cost and exactness."""

    codebooks: int
    """Codebooks per frame (Q) that `codec_decode` takes."""
    codebook_size: int
    delay_samples: int
    """Streamed PCM is the offline PCM preceded by this many samples."""
    decode: Callable[[np.ndarray], np.ndarray]
    """Codes (B, Q, T) -> float32 PCM (B, T * frame_samples - delay_samples), in one call."""


@dataclass(frozen=True)
class DuplexFrame:
    """One session's output of one lockstep step: a whole frame, silence included."""

    pcm: np.ndarray
    """`frame_samples` float32 samples at `output_rate`."""
    text: str
    """What the model's text stream wrote at this step ("" for padding)."""
    voiced: bool
    """Whether the model is speaking in this frame (a spoken segment holds voiced frames)."""


VOICED_RMS = 0.003
"""Output RMS (about -50 dBFS) from which a frame counts as speech rather than silence."""


def is_voiced(pcm: np.ndarray) -> bool:
    return len(pcm) > 0 and float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64)))) >= VOICED_RMS


StageTimer = Callable[[str, int], AbstractContextManager]
"""`timer(stage, batch_size)` wraps one batched stage call of a lockstep step, to time it."""


def untimed(stage: str, batch_size: int) -> AbstractContextManager:
    return nullcontext()


class DuplexModel(ABC):
    name: str
    input_rate: int
    """Sample rate of the PCM `encode_audio` takes."""
    output_rate: int
    """Sample rate of the PCM `codec_decode` returns."""
    input_chunk_samples: int
    """Samples (at input_rate) per `encode_audio` chunk."""
    frame_samples: int
    """Output samples (at output_rate) per codec frame."""
    max_thinker_lead: int = 4
    """Thinker tokens that may wait for the Talker; 1 makes the two strictly alternate."""
    accepts_text: bool = False
    """Whether `thinker_prefill` takes `TextTurn` features (text items, tool outputs)."""
    restores_context: bool = False
    """Whether decode reports token ids and `thinker_prefill` takes `ReplyTurn`: a context that
    can be rebuilt on another node after a resume."""
    rewinds_context: bool = False
    """Whether `thinker_prefill` takes `Mark` and `Rewind`: a context that can go back to an
    item boundary and be laid again from there (a conversation edited before its end)."""
    voices: tuple[str, ...] = ()
    """The Talker's speakers, by the names its checkpoint gives them."""
    default_voice: str | None = None
    supports_video: bool = False
    """Whether `encode_video` and video features in `thinker_prefill` mean anything."""
    accepts_partial_chunks: bool = False
    """Whether the last chunk of a turn may be short; if not, the engine pads it with silence."""
    device: str = "cpu"
    dtype: str = "float32"
    duplex_delay_frames: int | None = None
    """Native full duplex: the step that takes input frame k returns output frame k - delay + 1,
    so output frame k lies on the timeline at input frame k + delay. None: turns only."""

    def warm_up(self, max_batch: int) -> dict[str, Any]:
        """Prepare, before the first session, what serving must not stop for (CUDA graphs
        are captured here, never mid-serving) for stage calls of up to `max_batch` rows; what
        was prepared and checked, for /healthz and the bench ("warnings": what an operator
        must know)."""
        return {}

    @abstractmethod
    def new_state(self, session_id: str) -> ModelState: ...

    @abstractmethod
    def reset_response(self, state: ModelState) -> None:
        """Drop everything of the current reply (Talker KV, codec carry): the epoch moved on."""

    def free(self, state: ModelState) -> None:
        """Release everything the session holds; `bytes_held` is 0 afterwards."""
        for slot in state.slots.values():
            slot.release()
        state.slots.clear()

    def bytes_held(self, state: ModelState) -> int:
        return sum(slot.nbytes for slot in state.slots.values())

    def cache_stats(self) -> dict[str, CacheStats]:
        """The counters of the caches the model keeps across sessions, by cache name."""
        return {}

    def kv_stats(self) -> dict[str, KVStats]:
        """Its paged KV pools, by stage; none for a model whose KV is not paged."""
        return {}

    def graph_stats(self) -> dict[str, dict[str, int]]:
        """Per stage with fixed-shape steps, how many ran since the start by how they ran:
        "replays" (a CUDA graph captured at `warm_up`), "static" (its fixed buffers without a
        graph), "eager"; none for a model that has no such steps."""
        return {}

    @abstractmethod
    def encode_audio(self, states: list[ModelState], chunks: list[np.ndarray]) -> list[Any]:
        """Float32 mono chunks of `input_chunk_samples` at `input_rate` -> feature payloads."""

    def encode_video(self, states: list[ModelState], frames: list[np.ndarray]) -> list[Any]:
        """RGB uint8 frames (H, W, 3) -> feature payloads. Models without vision return None."""
        return [None for _ in frames]

    def clear_input(self, state: ModelState) -> None:
        """Forget input not yet answered, where the model can (a prefilled KV cannot)."""
        return None

    @abstractmethod
    def thinker_prefill(self, states: list[ModelState], features: list[Any]) -> None:
        """Append encoded input to each session's Thinker context."""

    def instruct(self, state: ModelState, instructions: str,
                 tools: tuple[dict[str, Any], ...]) -> None:
        """The session's instructions and tools, told as soon as they are set, so the system
        turn can open a context that has none yet. Models without one ignore it."""
        return None

    @abstractmethod
    def begin_response(self, state: ModelState, spec: ReplySpec | None = None) -> None:
        """Close the user turn in the Thinker context and prepare the reply `spec` asks for
        (None: the model's defaults)."""

    @abstractmethod
    def thinker_decode(self, states: list[ModelState]) -> list[ThinkerToken]: ...

    @abstractmethod
    def talker_step(
        self, states: list[ModelState], tokens: list[ThinkerToken | None]
    ) -> list[TalkerFrame]:
        """One codec frame per session; `tokens[i]` is new Thinker output or None if none came."""

    def offline_codec(self) -> OfflineCodec | None:
        """The codec's offline decoder, for the bench; None where there is none (echo)."""
        return None

    @abstractmethod
    def codec_decode(self, states: list[ModelState], codes: list[Any]) -> list[np.ndarray]:
        """Codes per session, (Q,) for one Talker frame or (Q, T) -> float32 PCM at output_rate."""

    def duplex_step(
        self, states: list[ModelState], frames: list[np.ndarray], timer: StageTimer = untimed
    ) -> list[DuplexFrame]:
        """One lockstep step of native full duplex: one input frame (`input_chunk_samples`
        float32) per session in, one output frame per session out, each stage one batched call.
        Only models with `duplex_delay_frames` implement it."""
        raise NotImplementedError(f"{self.name} does not run native full duplex")
