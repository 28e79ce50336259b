"""One session's state in a Qwen3-Omni adapter: its context, its reply, and the pool rows it holds.

The Thinker and Talker KV and the codec carry state live in pools the adapter shares across
sessions (`Pools`); a session holds slots in them, claimed on first use and given back when its
reply ends (Talker, codec) or it closes (Thinker). A session whose context starts from a prefix
cache entry pins that entry until it closes; its slot holds the entry's blocks by reference.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from models.kv import tensor_bytes
from models.paged_kv import PagedKV
from models.prefix_cache import PrefixCache, PrefixKey
from models.qwen3_omni.codec import Code2WavPool
from models.qwen3_omni.options import Stream
from models.reply import Truncation
from models.tool_forcing import CallForcing

if TYPE_CHECKING:
    from models.qwen3_omni.memory import KVMemory

OTHER, USER, PREFIX = 0, 1, 2
"""Role of a Thinker position for the Talker: none, user-turn context, assistant prefix."""


@dataclass(frozen=True)
class Pools:
    thinker: PagedKV
    talker: PagedKV
    codec: Code2WavPool
    prefix: PrefixCache
    memory: KVMemory


@dataclass
class Piece:
    """Consecutive Thinker positions of one kind, waiting for the next forward."""

    embeds: torch.Tensor
    positions: np.ndarray
    """(3, n) M-RoPE positions (temporal, height, width), on the host: a batch's index
    arrays are assembled there and cross to the device once (`models.syncs.upload`)."""
    role: int
    multimodal: bool = False
    deepstack: tuple[torch.Tensor, ...] | None = None


@dataclass
class Session:
    sid: str
    pools: Pools
    thinker_gen: Stream
    talker_gen: Stream
    thinker_slot: int | None = None
    keep: int = 0
    """Leading Thinker positions (the system prompt) that eviction never drops."""
    system: str | None = None
    """The system turn the context holds last (instructions and tools), as rendered."""
    head: tuple[int, ...] = ()
    """The token ids of the context's head (its first `keep` positions), while not forwarded."""
    prefix: PrefixKey | None = None
    """The prefix cache entry this session pins (its context's head), if any."""
    voice: str = ""
    temperature: float | None = None
    """This reply's; None for the adapter's own Thinker sampling."""
    forcing: CallForcing | None = None
    """The tool call this reply is writing to its grammar (forced by its tool_choice, or
    opened by the model); None: free."""
    call_tools: tuple[dict[str, Any], ...] = ()
    """The tools this reply was offered: a call it opens itself follows their schemas."""
    call_tail: str = ""
    """The end of the reply's text, where a call's opening tag is looked for."""
    token_limit: int = 0
    """Thinker tokens after which the adapter ends this reply (a forced call's own tokens
    come on top of the adapter's reply length)."""
    budget: int = 0
    """Tokens this reply may write at most: the adapter's limit, or the reply's if lower
    (past which the engine cuts it); a forced call closes within it."""
    truncation: Truncation = field(default_factory=Truncation)
    """The session's policy when the context fills (set with each reply)."""
    dropped: int = 0
    """Positions truncation dropped since the last reply's usage was reported (the next
    reply's usage reports them)."""
    full: bool = False
    """Truncation is disabled and input did not fit: the reply ends without a token."""
    kv_full: bool = False
    """The KV memory has no room for this reply: it ends with server_full."""
    lost_input: bool = False
    """Input was refused for want of KV memory: the next reply ends with server_full, so the
    user hears why it went unanswered."""
    cached: int = 0
    """Positions of the context taken from the prefix cache instead of computed (its head,
    when a cache entry held it)."""
    next_pos: int = 0
    marks: list = field(default_factory=list)
    """The context's item boundaries (`context.ContextMark`), in order."""
    evicted: int = 0
    """Positions truncation has dropped from this context, ever."""
    talker_taken: int = 0
    """User positions handed to the Talker, ever (it keeps the latest of them)."""
    turn: str | None = None
    audio_open: bool = False
    pending: list[Piece] = field(default_factory=list)
    talker_ctx: list[torch.Tensor] = field(default_factory=list)
    # The reply in progress.
    responding: bool = False
    thinker_done: bool = True
    last_token: int | None = None
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    talker_prefix: torch.Tensor | None = None
    talker_slot: int | None = None
    talker_pos: int = 0
    text_queue: deque[torch.Tensor] = field(default_factory=deque)
    eos_sent: bool = False
    frames: int = 0
    last_codes: torch.Tensor | None = None
    talker_done: bool = False
    codec_row: int | None = None

    @property
    def nbytes(self) -> int:
        pieces = [(p.embeds, p.deepstack or ()) for p in self.pending]
        held = tensor_bytes(
            [pieces, self.talker_ctx, self.talker_prefix, self.text_queue, self.last_codes]
        ) + sum(p.positions.nbytes for p in self.pending)
        if self.thinker_slot is not None:
            held += self.pools.thinker.slot_bytes(self.thinker_slot)
        if self.talker_slot is not None:
            held += self.pools.talker.slot_bytes(self.talker_slot)
        if self.codec_row is not None:
            held += self.pools.codec.row_bytes()
        return held

    def check(self) -> None:
        """Raise SlotOwnershipError if a row this session holds belongs to another now."""
        if self.thinker_slot is not None:
            self.pools.thinker.check(self.thinker_slot, self.sid)
        if self.talker_slot is not None:
            self.pools.talker.check(self.talker_slot, self.sid)

    def end_reply(self) -> None:
        """Drop the reply in progress and give back its Talker and codec rows, and the KV
        blocks it reserved and did not use."""
        self.pools.thinker.unreserve(self.sid)
        self.pools.talker.unreserve(self.sid)
        if self.talker_slot is not None:
            self.pools.talker.release(self.talker_slot, self.sid)
        if self.codec_row is not None:
            self.pools.codec.release(self.codec_row, self.sid)
        self.responding, self.thinker_done, self.forcing = False, True, None
        self.call_tools, self.call_tail = (), ""
        self.talker_slot, self.talker_pos, self.codec_row = None, 0, None
        self.talker_prefix, self.last_codes = None, None
        self.text_queue.clear()
        self.eos_sent, self.frames, self.talker_done = False, 0, False

    def release(self) -> None:
        self.end_reply()
        if self.thinker_slot is not None:
            self.pools.thinker.release(self.thinker_slot, self.sid)
        if self.prefix is not None:
            self.pools.prefix.release(self.prefix)
        self.pools.memory.remove(self)
        self.thinker_slot, self.prefix = None, None
        self.pending.clear()
        self.talker_ctx.clear()
        self.marks.clear()
