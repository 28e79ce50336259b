"""The Thinker's context as a conversation: turns of their own for the items that are not the
user's (system messages, assistant messages and function calls a client laid in), marks at
item boundaries, and rewinds to them.

A mark closes the turn open at the boundary and records where the context then stood: the
positions after the head (evicted ones counted, so that truncation moves the mark back with
the positions it dropped), the next rotary position, the system turn then latest, and the user
positions the Talker will have taken. A rewind truncates the KV there and forgets everything
after: the positions before it keep their KV, so an edit costs the prefill of what follows it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from models.base import TextTurn
from models.qwen3_omni.session import OTHER, USER, Session

OWN_TURNS = ("system", "assistant", "function_call")
"""`TextTurn` roles laid as whole turns of their own, not inside the user's."""


@dataclass(frozen=True)
class ContextMark:
    key: int
    after_head: int
    """Positions after the head when the mark was laid, evicted ones included."""
    pos: int
    """The next rotary position, counted from the head's end."""
    system: str | None
    talker: int
    """User positions handed to the Talker up to the mark."""


def call_text(text: str) -> str:
    """A function call (JSON name and arguments) as Qwen's chat template writes the model's
    own: the arguments as the JSON text the client sent."""
    call = json.loads(text)
    arguments = call.get("arguments") or "{}"
    return (f'<tool_call>\n{{"name": {json.dumps(call["name"])}, "arguments": {arguments}}}'
            "\n</tool_call>")


class ConversationTurns:
    """What `Thinker` adds for a conversation a client edits; it provides `ids`, `kv`,
    `tokenizer`, `push_text`, `close_reply`, `close_audio`, `_fits`, `_open_head`, `forward`,
    `prefix_cache` and `version`."""

    def end_turn(self, sess: Session) -> None:
        """Close the turn that is open: a reply that ended, or the user's."""
        if sess.turn == "assistant":
            self.close_reply(sess)
        elif sess.turn == "user":
            self.close_audio(sess)
            self.push_text(sess, [self.ids["im_end"], self.ids["newline"]], USER)
            sess.turn = None

    def own_turn(self, sess: Session, turn: TextTurn) -> None:
        """A system or assistant turn laid whole, as the chat template renders the message."""
        self.end_turn(sess)
        ids = self.ids
        role = "system" if turn.role == "system" else "assistant"
        text = call_text(turn.text) if turn.role == "function_call" else turn.text
        body = self.tokenizer.encode(text, add_special_tokens=False)
        self.push_text(sess, [ids["im_start"], ids[role], ids["newline"], *body, ids["im_end"],
                              ids["newline"]], OTHER)

    def mark(self, sess: Session, key: int) -> None:
        self.end_turn(sess)
        pending = sum(p.embeds.shape[0] for p in sess.pending)
        user = sum(p.embeds.shape[0] for p in sess.pending if p.role == USER)
        length = self.kv.length[sess.thinker_slot] if sess.thinker_slot is not None else 0
        sess.marks.append(ContextMark(key, length + pending - sess.keep + sess.evicted,
                                      sess.next_pos - sess.keep, sess.system,
                                      sess.talker_taken + user))

    def rewind(self, sess: Session, key: int) -> None:
        at = next((i for i in range(len(sess.marks) - 1, -1, -1) if sess.marks[i].key == key),
                  None)
        if at is None:
            raise ValueError(f"{sess.sid}: the context holds no mark {key} to rewind to")
        mark = sess.marks[at]
        del sess.marks[at:]
        if sess.pending and self._fits(sess):
            self.forward_pending([sess])
        sess.pending = []
        if sess.thinker_slot is not None:
            length = self.kv.length[sess.thinker_slot]
            # A mark inside what truncation evicted comes back to the head.
            target = max(sess.keep, sess.keep + mark.after_head - sess.evicted)
            self.kv.truncate(sess.thinker_slot, sess.sid, min(length, target))
        sess.next_pos = sess.keep + mark.pos
        sess.system = mark.system
        sess.turn, sess.audio_open, sess.last_token = None, False, None
        drop = sess.talker_taken - mark.talker
        if drop > 0 and sess.talker_ctx:
            held = torch.cat(sess.talker_ctx)
            sess.talker_ctx = [held[: max(0, held.shape[0] - drop)]]
        sess.talker_taken = mark.talker

    def forward_pending(self, sessions: list[Session]) -> None:
        """Forward the sessions' pending positions; a head pending alone (a mark laid before any
        input) is copied from the prefix cache where it can be, leaving nothing to forward."""
        for sess in sessions:
            if sess.head and len(sess.pending) == 1 and sess.prefix is None \
                    and (self.version, sess.head) in self.prefix_cache:
                self._open_head(sess)
        sessions = [sess for sess in sessions if sess.pending]
        if sessions:
            self.forward(sessions)

    def marks_follow_head(self, sess: Session) -> None:
        """The head was replaced while nothing followed it: the marks there carry its system
        turn."""
        sess.marks = [replace(m, system=sess.system) for m in sess.marks]
