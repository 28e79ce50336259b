"""Who may take how much of the Thinker and Talker KV pools (`models.paged_kv`).

- A new session is admitted only while its head (the server's system turn) and its first
  reply fit beside what is held (`stats().sessions_admissible`, checked by the engine).
- A reply starts only if the blocks it may need are there: its pending input and its token
  budget in the Thinker pool, its longest audio in the Talker pool. They are reserved for it,
  so a reply in progress never runs short; what it leaves unused goes back when it ends.
  Otherwise it fails at once with `server_full`.
- A context grows into free blocks. A session's share is the Thinker pool divided among the
  live sessions: a context that would outgrow its share is cut by its own truncation policy,
  and when a session within its share finds no free block, sessions past theirs are cut first.
  A policy of `disabled` is never cut: past its share (or the context limit) its input is
  refused and its reply fails with `context_length_exceeded`; a session within its share for
  which no block can be freed has its input refused and its reply fails with `server_full`.

Cutting follows the session's `truncation`: the positions after its system turn (`keep`) go,
oldest first, until the context is as long as the policy leaves it (`cut`).
"""

from __future__ import annotations

import math

from models.base import KVStats
from models.paged_kv import PagedKV
from models.qwen3_omni.options import Qwen3OmniOptions
from models.qwen3_omni.session import Session

THINKER, TALKER = "thinker", "talker"
"""The stages' names, as `/metrics` and the bench spell them."""

TALKER_PREFIX = 16
"""Talker positions of a reply before its first frame, beyond the user turns: the assistant
prefix (9 in Qwen3-Omni's template), rounded up."""


def talker_positions(options: Qwen3OmniOptions) -> int:
    """The most Talker positions one reply holds: user turns, prefix, one per frame."""
    return options.talker_context + TALKER_PREFIX + options.max_frames


def cut(kv: PagedKV, sess: Session, limit: int, n: int) -> bool:
    """Drop the session's oldest positions after `keep`, as its truncation policy says, so that
    `n` more fit within `limit`; False (dropping nothing) when even dropping all would not do."""
    slot, keep = sess.thinker_slot, sess.keep
    length = kv.length[slot]
    if length + n <= limit:
        return True
    if n > limit - keep:
        return False
    policy = sess.truncation
    if policy.type == "retention_ratio":
        target = math.floor(policy.ratio * (limit - keep))
    else:
        target = limit - keep - limit // 4
    drop = min(max(length + n - limit, length - keep - target), length - keep)
    kv.evict(slot, keep, drop)
    sess.dropped += drop
    sess.evicted += drop
    return True


class KVMemory:
    def __init__(self, thinker: PagedKV, talker: PagedKV, options: Qwen3OmniOptions,
                 head: int) -> None:
        """`head`: positions of the server's own system turn, which every session opens with."""
        self.thinker, self.talker, self.options, self.head = thinker, talker, options, head
        self.sessions: dict[str, Session] = {}

    def add(self, sess: Session) -> None:
        self.sessions[sess.sid] = sess

    def remove(self, sess: Session) -> None:
        self.sessions.pop(sess.sid, None)

    # ---- shares ------------------------------------------------------------------------------

    def session_blocks(self) -> tuple[int, int]:
        """(Thinker, Talker) blocks a new session needs: its head and a reply at full length
        (a block more in the Thinker, for the copy of a shared block it writes into)."""
        opts = self.options
        return (self.thinker.blocks_for(self.head + opts.max_text_tokens) + 1,
                self.talker.blocks_for(talker_positions(opts)))

    def share(self) -> int:
        """Thinker blocks of its own each live session may hold (at least one reply's)."""
        return max(self.session_blocks()[0],
                   self.thinker.blocks_total // max(1, len(self.sessions)))

    def share_positions(self, sess: Session) -> int:
        """The context length the session's share allows: its shared blocks (a cached head)
        come on top of its own."""
        kv = self.thinker
        slot = sess.thinker_slot
        shared = len(kv.rows[slot]) - kv.private_blocks(slot)
        return (shared + self.share()) * kv.block_size

    def fits(self, sess: Session, n: int) -> bool:
        """Reserve the Thinker blocks for `n` more positions of the session (beyond what it
        has reserved), after cutting sessions past their share if need be; False when they
        are not there. A forward's rows reserve one after another, so together they never
        take more than there is; the forward gives back what it did not use
        (`end_forward`)."""
        kv = self.thinker
        need = kv.blocks_needed(sess.thinker_slot, n) - kv.reserved.get(sess.sid, 0)
        if need > kv.available and not self._make_room(sess, need):
            return False
        return kv.reserve(sess.sid, need)

    def end_forward(self, sess: Session) -> None:
        """A forward is done: a session whose reply is not writing text keeps no blocks
        reserved (a head taken from the prefix cache, say, needed fewer than it reserved)."""
        if not sess.responding or sess.thinker_done:
            self.thinker.unreserve(sess.sid)

    def _make_room(self, sess: Session, need: int) -> bool:
        """Cut the sessions furthest past their share, by their own policies, until `need`
        blocks are free; False when that is not enough."""
        kv, share = self.thinker, self.share()
        tried: set[str] = set()
        while need > kv.available:
            over = [s for s in self.sessions.values()
                    if s is not sess and s.sid not in tried and s.thinker_slot is not None
                    and s.truncation.type != "disabled"
                    and kv.private_blocks(s.thinker_slot) > share]
            if not over:
                return False
            other = max(over, key=lambda s: kv.private_blocks(s.thinker_slot))
            tried.add(other.sid)
            cut(kv, other, self.share_positions(other), 0)
        return True

    # ---- replies -----------------------------------------------------------------------------

    def begin_reply(self, sess: Session, audio: bool) -> bool:
        """Reserve what the reply may need: its pending input and token budget in the Thinker
        pool (up to the session's share: a context that would outgrow it is cut first, by its
        own policy), and its audio in the Talker's; False (reserving nothing) when they are
        not there."""
        kv, slot = self.thinker, sess.thinker_slot
        positions = sum(p.embeds.shape[0] for p in sess.pending) + sess.budget
        room = self.share_positions(sess)
        if kv.length[slot] + positions > room and sess.truncation.type != "disabled":
            cut(kv, sess, room, positions)
        need = kv.blocks_needed(slot, min(positions, max(0, room - kv.length[slot])))
        if need > kv.available and not self._make_room(sess, need):
            return False
        kv.reserve(sess.sid, need)
        if audio and not self.talker.reserve(sess.sid, self.session_blocks()[1]):
            kv.unreserve(sess.sid)
            return False
        return True

    def end_text(self, sess: Session) -> None:
        """The reply's text is done: what it did not use of its Thinker blocks goes back."""
        self.thinker.unreserve(sess.sid)

    # ---- figures -----------------------------------------------------------------------------

    def stats(self) -> dict[str, KVStats]:
        thinker_need, talker_need = self.session_blocks()
        kv = self.thinker
        by_share = kv.blocks_total // thinker_need - len(self.sessions)
        admissible = max(0, min(kv.available // thinker_need, by_share))
        # The Talker's blocks are a reply's only while it speaks: a session is refused when
        # not even one more reply would find them, not counted against them.
        if self.talker.available < talker_need:
            admissible = 0
        return {THINKER: _stats(kv, thinker_need, admissible),
                TALKER: _stats(self.talker, talker_need, admissible)}


def _stats(kv: PagedKV, session_blocks: int, admissible: int) -> KVStats:
    lengths = [kv.length[s] for s in kv.slots()]
    position = kv.layout.position_bytes
    longest = max(lengths, default=0)
    slot_capacity = max(64, -(-longest // 64) * 64) if lengths else 0
    return KVStats(
        blocks_total=kv.blocks_total,
        blocks_used=kv.blocks_used,
        block_bytes=kv.block_bytes,
        blocks_free=max(0, kv.available),
        session_blocks=session_blocks,
        sessions_admissible=admissible,
        needed_bytes=sum(lengths) * position,
        slot_pool_bytes=len(lengths) * slot_capacity * position,
    )
