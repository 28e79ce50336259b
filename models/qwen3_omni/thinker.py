"""The Thinker side of the Qwen3-Omni adapter: each session's chat context, batched forwards over
the paged KV, and reply tokens.

New positions wait in a session as pieces (text, audio or image embeddings with their M-RoPE
positions) until the next forward, which takes every session's pieces at once. A user turn opens
with the first input after a reply and closes at `begin`; input during a reply ends that reply's
text. Every forward hands the Talker the positions it conditions on.

A context's head (the system turn set before any input) is computed once per model version
and token sequence: the first session to forward it keeps its KV blocks in the prefix cache,
later ones start their block table with the same blocks instead of computing it.

How much KV a context may hold is `models.qwen3_omni.memory`'s: its context limit and its
share of the pool, each enforced by the session's truncation policy.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from models.base import Mark, ReplyTurn, Rewind, TextTurn, ThinkerToken
from models.cuda_graphs import BucketGraphs, GraphSettings, step_counts
from models.paged_kv import PagedKV
from models.paged_static import StaticStep
from models.prefix_cache import PrefixCache, PrefixKV
from models.qwen3_omni import compat
from models.qwen3_omni.context import OWN_TURNS, ConversationTurns
from models.qwen3_omni.encoders import AudioFeatures, VisionFeatures
from models.qwen3_omni.memory import KVMemory, cut
from models.qwen3_omni.options import Qwen3OmniOptions, sample_rows
from models.qwen3_omni.session import OTHER, PREFIX, USER, Piece, Session
from models.qwen3_omni.talker import Talker
from models.syncs import fetch, upload
from models.tool_forcing import OPEN, CallForcing, CallMasks, Vocabulary, forced_names


class ContextTooLong(ValueError):
    """One input does not fit in the context even after evicting everything evictable."""


class Thinker(ConversationTurns):
    def __init__(
        self,
        model,
        tokenizer,
        kv: PagedKV,
        talker: Talker,
        options: Qwen3OmniOptions,
        device,
        dtype,
        prefix_cache: PrefixCache,
        version: str,
        memory: KVMemory,
        graphs: GraphSettings | None = None,
    ) -> None:
        """`version` identifies the language model's weights (`models.fingerprint`); `graphs`
        says whether decode steps run from fixed buffers, captured as CUDA graphs."""
        self.module = model.thinker
        self.lm = compat.thinker_parts(model).text
        self.tokenizer = tokenizer
        self.kv, self.talker, self.options = kv, talker, options
        self.device, self.dtype = device, dtype
        self.ids = token_ids(tokenizer, model.config)
        self.eos_ids = sorted(self.ids["eos"])
        vocab = model.config.thinker_config.text_config.vocab_size
        # Masks over the vocabulary, on the device once: a step fills with them, where
        # indexing by a boolean mask or a list of ids would sync or copy every time.
        self.suppress = _suppressed(tokenizer, vocab, self.ids["eos"]).to(device)
        self.eos = torch.zeros(vocab, dtype=torch.bool)
        self.eos[self.eos_ids] = True
        self.eos = self.eos.to(device)
        self.prefix_cache, self.memory = prefix_cache, memory
        # A cache entry is blocks of this pool: the key says which.
        self.version = f"{version}@kv{kv.uid}"
        self.vocab_size = vocab
        self._vocabulary: Vocabulary | None = None
        self.masks = CallMasks(vocab, device)
        self.positions = 0
        """Positions computed by forwards since the Thinker was made (prefix cache hits not)."""
        graphs = graphs or GraphSettings()
        hidden = model.config.thinker_config.text_config.hidden_size
        self.graphs = BucketGraphs(
            "Thinker decode",
            lambda batch: StaticStep(self.lm, compat.THINKER_CACHE, kv, batch, hidden, dtype),
            graphs.capture, graphs.pool) if graphs.static else None
        self.steps = step_counts()
        """Decode steps (the one-position rows of a decode call) by how they ran."""

    def start(self, sess: Session) -> None:
        """Open a new session's context with the server's own system prompt, if it has one."""
        self.memory.add(sess)
        self._system_turn(sess, render_system(self.options.system_prompt or "", ()))

    def instruct(self, sess: Session, instructions: str, tools: tuple[dict[str, Any], ...]) -> None:
        """Instructions set before any input open the context (the system turn at its head, as
        the chat template lays it out); later ones wait for the next reply (`begin`)."""
        if sess.next_pos == sess.keep:
            self._system_turn(sess, self._system_text(instructions, tools))

    def forcing(self, tool_choice: str | dict[str, Any],
                tools: tuple[dict[str, Any], ...]) -> CallForcing | None:
        """The constraint that makes a reply a call, when the tool choice asks for one."""
        names = forced_names(tool_choice, tools)
        if not names:
            return None
        return CallForcing(self.vocabulary(), tools, names)

    def vocabulary(self) -> Vocabulary:
        """Built at the first call a reply makes, not with the model: most sessions make none."""
        if self._vocabulary is None:
            self._vocabulary = Vocabulary(self.tokenizer, self.vocab_size, self.ids["im_end"])
        return self._vocabulary

    def _watch_call(self, sess: Session, text: str) -> None:
        """A reply that opens a call of its own writes it to its tools' schemas from there."""
        if sess.forcing is not None or not sess.call_tools:
            return
        sess.call_tail = (sess.call_tail + text)[-4 * len(OPEN):]
        at = sess.call_tail.find(OPEN)
        if at < 0:
            return
        written = sess.call_tail[at + len(OPEN):]
        sess.call_tail = ""
        vocab = self.vocabulary()
        forcing = CallForcing(vocab, sess.call_tools, [t["name"] for t in sess.call_tools],
                              opened=True)
        for token in vocab.tokens(written) if written else ():
            forcing.advance(token)
        sess.forcing = None if forcing.broken else forcing

    def _system_text(self, instructions: str, tools: tuple[dict[str, Any], ...]) -> str:
        return render_system(instructions or self.options.system_prompt or "", tools)

    def _system_turn(self, sess: Session, text: str) -> None:
        """Make `text` the context's system turn: at its head while it holds nothing else
        (never forwarded, so the old head can simply be replaced), else appended here."""
        if text == (sess.system or ""):
            return
        head = sess.next_pos == sess.keep
        if head:
            self._drop_head(sess)
            sess.pending, sess.next_pos, sess.keep, sess.head = [], 0, 0, ()
        sess.system = text
        if head:
            self.marks_follow_head(sess)
        if not text:
            return
        ids = self.ids
        body = self.tokenizer.encode(text, add_special_tokens=False)
        tokens = [ids["im_start"], ids["system"], ids["newline"], *body, ids["im_end"],
                  ids["newline"]]
        self.push_text(sess, tokens, OTHER)
        if head:
            sess.keep, sess.head = len(tokens), tuple(tokens)

    def _drop_head(self, sess: Session) -> None:
        """Forget a head already forwarded (a context rewound to its start)."""
        if sess.thinker_slot is not None and self.kv.length[sess.thinker_slot]:
            self.kv.truncate(sess.thinker_slot, sess.sid, 0)
        if sess.prefix is not None:
            self.prefix_cache.release(sess.prefix)
            sess.prefix = None

    @torch.inference_mode()
    def push_text(self, sess: Session, tokens: list[int], role: int) -> None:
        embeds = self.module.get_input_embeddings()(upload(tokens, self.device))
        self.push(sess, embeds, role)

    def push(
        self, sess: Session, embeds: torch.Tensor, role: int, multimodal: bool = False
    ) -> None:
        n = embeds.shape[0]
        pos = np.broadcast_to(np.arange(sess.next_pos, sess.next_pos + n), (3, n))
        sess.pending.append(Piece(embeds, pos, role, multimodal))
        sess.next_pos += n

    def push_vision(self, sess: Session, feats: VisionFeatures) -> None:
        h, w = feats.grid
        start = sess.next_pos
        hh, ww = np.divmod(np.arange(h * w), w)
        pos = np.stack([np.zeros_like(hh), hh, ww]) + start
        sess.pending.append(Piece(feats.embeds, pos, USER, True, feats.deepstack))
        sess.next_pos = start + max(h, w)

    def close_reply(self, sess: Session) -> None:
        """End the assistant turn in the Thinker context (its tokens were fed except the last)."""
        ids = self.ids
        tokens = [] if sess.last_token in (None, *ids["eos"]) else [sess.last_token]
        self.push_text(sess, [*tokens, ids["im_end"], ids["newline"]], OTHER)
        sess.last_token = None
        sess.thinker_done = True
        sess.turn = None

    def open_user(self, sess: Session) -> None:
        if sess.turn == "assistant":
            self.close_reply(sess)
        if sess.turn is None:
            ids = self.ids
            self.push_text(sess, [ids["im_start"], ids["user"], ids["newline"]], USER)
            sess.turn = "user"

    def close_audio(self, sess: Session) -> None:
        if sess.audio_open:
            self.push_text(sess, [self.ids["audio_end"]], USER)
            sess.audio_open = False

    def prefill(self, sessions: list[Session], features: list[Any]) -> None:
        for feat in features:
            if not isinstance(feat, (AudioFeatures, VisionFeatures, TextTurn, ReplyTurn, Mark,
                                     Rewind, type(None))):
                raise TypeError(f"cannot prefill {type(feat).__name__}")
        ids = self.ids
        rows = []
        for sess, feat in zip(sessions, features, strict=True):
            if feat is None:
                continue
            if isinstance(feat, Rewind):
                self.rewind(sess, feat.key)
                if feat.system is not None:
                    self.instruct(sess, *feat.system)
                continue
            if isinstance(feat, Mark):
                # What it closes is forwarded with what comes next (`rewind` sees to it).
                self.mark(sess, feat.key)
                continue
            own = isinstance(feat, TextTurn) and feat.role in OWN_TURNS
            if isinstance(feat, ReplyTurn) or own:
                if own:
                    self.own_turn(sess, feat)
                else:
                    self.restore_reply(sess, feat)
                rows.append(sess)
                continue
            self.open_user(sess)
            if isinstance(feat, AudioFeatures):
                if not sess.audio_open:
                    self.push_text(sess, [ids["audio_start"]], USER)
                    sess.audio_open = True
                self.push(sess, feat.embeds.to(self.dtype), USER, multimodal=True)
            else:
                self.close_audio(sess)
                if isinstance(feat, VisionFeatures):
                    self.push_text(sess, [ids["vision_start"]], USER)
                    self.push_vision(sess, feat)
                    self.push_text(sess, [ids["vision_end"]], USER)
                else:
                    self.push_text(sess, self._text_tokens(feat), USER)
            rows.append(sess)
        self.forward_pending([sess for sess in rows if self._fits(sess)])

    def begin(self, sess: Session, instructions: str = "",
              tools: tuple[dict[str, Any], ...] = ()) -> None:
        """Close the user turn and open the assistant's; the previous reply must be ended.
        Instructions (or tools) other than the context's latest system turn come in a system
        turn of their own just before the reply."""
        ids = self.ids
        self.end_turn(sess)
        self._system_turn(sess, self._system_text(instructions, tools))
        self.push_text(sess, [ids["im_start"], ids["assistant"], ids["newline"]], PREFIX)
        sess.turn = "assistant"
        sess.responding, sess.thinker_done = True, False
        sess.token_ids, sess.prefix_offset, sess.read_offset = [], 0, 0
        sess.talker_done = False
        if sess.truncation.type != "disabled":
            sess.full = False
        sess.kv_full = False

    def admit_reply(self, sess: Session, audio: bool) -> None:
        """Reserve the KV the reply begun may need; without room it ends with server_full."""
        self._open_slot(sess)
        if not self.memory.begin_reply(sess, audio):
            sess.kv_full = True

    def restore_reply(self, sess: Session, turn: ReplyTurn) -> None:
        """Lay a heard reply into the context as `begin` and `decode` laid it when it was
        generated: its prefix, every token but the last (the next turn's `close_reply` ends
        the turn with it, as it does after a live reply)."""
        self.begin(sess, turn.instructions, turn.tools)
        sess.responding, sess.thinker_done = False, True
        if len(turn.ids) > 1:
            self.push_text(sess, list(turn.ids[:-1]), OTHER)
        sess.last_token = turn.ids[-1] if turn.ids else None

    def _limit(self, sess: Session) -> int:
        post = sess.truncation.post_instructions
        limit = self.options.max_context
        return limit if post is None else min(limit, sess.keep + post)

    def _fits(self, sess: Session) -> bool:
        """Make room for the session's pending positions as its truncation policy says, within
        its context limit and its share of the KV memory; False when there is none to make:
        the pending input is refused (`full` past the limit or the share, `lost_input` when no
        block can be freed for it)."""
        self._open_slot(sess)
        n = sum(p.embeds.shape[0] for p in sess.pending)
        length, limit = self.kv.length[sess.thinker_slot], self._limit(sess)
        room = min(limit, self.memory.share_positions(sess))
        if length + n > room:
            if sess.truncation.type == "disabled":
                return self._refuse(sess, memory=False)
            if n > limit - sess.keep:
                raise ContextTooLong(f"{sess.sid}: {n} new positions, {limit - sess.keep} "
                                     "evictable")
            if not cut(self.kv, sess, room, n):
                return self._refuse(sess, memory=False)
        return self.memory.fits(sess, n) or self._refuse(sess, memory=True)

    @staticmethod
    def _refuse(sess: Session, memory: bool) -> bool:
        sess.pending = []
        if memory:
            sess.lost_input = True
        else:
            sess.full = True
        return False

    def forward(self, sessions: list[Session], step: bool = False) -> torch.Tensor:
        """Every session's pending pieces forwarded -> each row's last hidden state. `step`:
        the rows are a decode step's, one position each (`decode`).

        One forward, or two when sessions of the batch open with the same head that the cache
        does not hold yet: the first session computes it in the first forward, the others
        copy it from the cache for the second instead of computing it again."""
        later, computing = [], set()
        for sess in sessions:
            if sess.head and sess.prefix is None and self.prefix_cache.enabled:
                prefix = (self.version, sess.head)
                if prefix in computing:
                    later.append(sess)
                elif prefix not in self.prefix_cache:
                    computing.add(prefix)
        if not later:
            return self._forward(sessions, step)
        deferred = {id(sess) for sess in later}
        first = [sess for sess in sessions if id(sess) not in deferred]
        rows = torch.cat([self._forward(first, step), self._forward(later, step)])
        order = {id(sess): i for i, sess in enumerate(first + later)}
        return rows[torch.tensor([order[id(sess)] for sess in sessions], device=rows.device)]

    def _forward(self, sessions: list[Session], step: bool = False) -> torch.Tensor:
        """One forward over every session's pending pieces -> each row's last hidden state."""
        heads = [sess for sess in sessions if self._open_head(sess)]
        pieces = [sess.pending for sess in sessions]
        new = [sum(p.embeds.shape[0] for p in row) for row in pieces]
        self.positions += sum(new)
        q, batch = max(new), len(sessions)
        embeds = torch.nn.utils.rnn.pad_sequence(
            [torch.cat([p.embeds for p in row]) for row in pieces], batch_first=True
        )
        # What each position is, laid out on the host and sent over in one upload each.
        positions = np.zeros((3, batch, q), dtype=np.int64)
        role = np.zeros((batch, q), dtype=np.int8)
        multimodal = np.zeros((batch, q), dtype=bool)
        visual = np.zeros((batch, q), dtype=bool)
        deep: list[list[torch.Tensor]] = []
        for b, row in enumerate(pieces):
            at = 0
            for piece in row:
                n = piece.embeds.shape[0]
                positions[:, b, at : at + n] = piece.positions
                role[b, at : at + n] = piece.role
                multimodal[b, at : at + n] = piece.multimodal
                if piece.deepstack is not None:
                    visual[b, at : at + n] = True
                    deep = deep or [[] for _ in piece.deepstack]
                    for layer, feats in zip(deep, piece.deepstack, strict=True):
                        layer.append(feats)
                at += n
            # Padding repeats the last position so rotary phases stay in range.
            positions[:, b, at:] = positions[:, b, at - 1 : at]
        capture = bool((multimodal & (role == USER)).any())
        slots, owners = [s.thinker_slot for s in sessions], [s.sid for s in sessions]
        accepted = None
        if step and self.graphs is not None and self.graphs.holds(batch) and q == 1 \
                and not (capture or deep):
            last = self._static_step(slots, owners, new, embeds, positions)
        else:
            accept = self.talker.accept_layer
            kv = self.kv.bind(slots, owners, new)
            out = self.lm(
                inputs_embeds=embeds,
                attention_mask=kv.mask,
                position_ids=upload(positions, self.device),
                **{compat.THINKER_CACHE: kv},
                use_cache=True,
                visual_pos_masks=upload(visual, self.device, torch.bool) if deep else None,
                deepstack_visual_embeds=[torch.cat(layer) for layer in deep] if deep else None,
                output_hidden_states=[accept] if capture else False,
            )
            kv.commit()
            if step:
                self.steps["eager"] += 1
            accepted = out.hidden_states[accept] if capture else None
            ends = upload([n - 1 for n in new], self.device)
            last = out.last_hidden_state[torch.arange(batch, device=self.device), ends]
        for sess in sessions:
            self.memory.end_forward(sess)
        for sess in heads:
            prefix = (self.version, sess.head)
            blocks = self.kv.hold(sess.thinker_slot, sess.keep)
            if self.prefix_cache.keep(prefix, PrefixKV(self.kv, blocks, sess.keep)):
                sess.prefix = prefix
        for sess in sessions:
            sess.pending, sess.head = [], ()
        self.talker.take_context(sessions, embeds, accepted, role, multimodal & (role == USER))
        return last

    def _static_step(self, slots: list[int], owners: list[str], new: list[int],
                     embeds: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        """A decode step through the fixed buffers of the bucket holding its batch (replayed
        as a CUDA graph where one was captured) -> each row's hidden state."""
        batch = len(slots)
        meta = self.kv.plan(slots, owners, new)
        static = self.graphs.static(batch)
        static.load(embeds, upload(positions, self.device), meta)
        self.steps[self.graphs.run(batch)] += 1
        self.kv.commit(slots, new)
        return static.hidden[:batch].clone()

    def _open_slot(self, sess: Session) -> None:
        if sess.thinker_slot is None:
            sess.thinker_slot = self.kv.acquire(sess.sid)

    def _open_head(self, sess: Session) -> bool:
        """True when the session's head is still to be computed (and then kept in the prefix
        cache); a head the cache holds starts the session's block table instead."""
        self._open_slot(sess)
        if not sess.head or sess.prefix is not None:
            return False
        prefix = (self.version, sess.head)
        cached = self.prefix_cache.take(prefix)
        if cached is None:
            return True
        self.kv.share(sess.thinker_slot, cached.blocks, cached.length)
        sess.prefix, sess.cached = prefix, cached.length
        # The head is the first piece pushed (`_system_turn`), and never shares it.
        sess.pending.pop(0)
        return False

    def decode(self, sessions: list[Session]) -> list[ThinkerToken]:
        active = [s for s in sessions if s.responding and not s.thinker_done]
        results: dict[int, ThinkerToken] = {}
        if active:
            embed = self.module.get_input_embeddings()
            fed = [sess for sess in active if sess.last_token is not None]
            if fed:
                embeds = embed(upload([sess.last_token for sess in fed], self.device))
                for i, sess in enumerate(fed):
                    self.push(sess, embeds[i : i + 1], OTHER)
            for sess in [s for s in active if s.full or s.kv_full or s.lost_input
                         or not self._fits(s)]:
                sess.thinker_done = True
                memory = sess.kv_full or sess.lost_input
                reason = "server_full" if memory else "context_length_exceeded"
                results[id(sess)] = ThinkerToken("", None, True, reason=reason)
                sess.lost_input = False
                self.memory.end_text(sess)
            active = [s for s in active if id(s) not in results]
        if active:
            embed = self.module.get_input_embeddings()
            # A reply's first step forwards the assistant prefix, the others one position:
            # apart, no row is padded to the prefix; they meet again to sample.
            steps = [s for s in active if sum(p.embeds.shape[0] for p in s.pending) == 1]
            active = steps + [s for s in active if id(s) not in {id(t) for t in steps}]
            groups = ((steps, True), (active[len(steps):], False))
            last = torch.cat([self.forward(group, step) for group, step in groups if group])
            logits = self.module.lm_head(last).float()
            raw = logits.clone() if any(s.forcing for s in active) else logits
            logits.masked_fill_(self.suppress, -math.inf)
            opts = self.options
            no_eos = [len(s.token_ids) < opts.min_text_tokens for s in active]
            if any(no_eos):
                rows = upload(no_eos, self.device, torch.bool)
                logits.masked_fill_(rows[:, None] & self.eos, -math.inf)
            self._constrain(logits, raw, active)
            base = opts.thinker_sampling
            samplings = [base if s.temperature is None else replace(base, temperature=s.temperature)
                         for s in active]
            tokens = sample_rows(logits, samplings, [s.thinker_gen for s in active])
            conditioning = self.talker.conditioning(embed(tokens))
            for b, (sess, tok) in enumerate(zip(active, fetch(tokens).tolist(), strict=True)):
                if sess.forcing is not None:
                    sess.forcing.advance(tok)
                    if sess.forcing.broken or sess.forcing.finished and not sess.forcing.ends_turn:
                        sess.forcing = None
                sess.last_token = tok
                is_eos = tok in self.ids["eos"]
                sess.token_ids.append(tok)
                sess.thinker_done = is_eos or len(sess.token_ids) >= sess.token_limit
                usage = None
                if len(sess.token_ids) == 1:
                    usage = {"input_tokens": self.kv.length[sess.thinker_slot],
                             "cached_tokens": sess.cached, "truncated_tokens": sess.dropped,
                             "truncation": sess.truncation.type}
                    sess.dropped = 0
                text = self._detokenize(sess)
                self._watch_call(sess, text)
                results[id(sess)] = ThinkerToken(text, conditioning[b], sess.thinker_done, tok,
                                                 usage)
        for sess in active:
            if sess.thinker_done:
                self.memory.end_text(sess)
        return [results.get(id(s), ThinkerToken("", None, True)) for s in sessions]

    def _constrain(self, logits: torch.Tensor, raw: torch.Tensor,
                   active: list[Session]) -> None:
        """Rows writing a tool call keep only the tokens its grammar allows (`CallMasks`)."""
        rows = [(b, sess.forcing, sess.budget - len(sess.token_ids))
                for b, sess in enumerate(active) if sess.forcing is not None]
        if rows:
            self.masks.apply(logits, raw, rows)

    def _text_tokens(self, turn: TextTurn) -> list[int]:
        """A tool's output goes in the user turn inside the template's tool_response tags."""
        text = turn.text
        if turn.role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _detokenize(self, sess: Session) -> str:
        """The text the newest token completes; bytes of an unfinished character wait."""
        decode = self.tokenizer.decode
        ids = sess.token_ids
        before = decode(ids[sess.prefix_offset : sess.read_offset], skip_special_tokens=True)
        after = decode(ids[sess.prefix_offset :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            sess.prefix_offset, sess.read_offset = sess.read_offset, len(ids)
            return after[len(before) :]
        return ""


def token_ids(tok, cfg) -> dict[str, Any]:
    """The ids of the chat template's tokens, and every id that ends a reply ("eos")."""

    def one(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is not one token in this tokenizer")
        return ids[0]

    eos = {cfg.im_end_token_id}
    for name in ("eos_token", "pad_token"):
        if getattr(tok, name, None) in ("<|im_end|>", "<|endoftext|>"):
            eos.add(tok.convert_tokens_to_ids(getattr(tok, name)))
    return {
        "im_start": cfg.im_start_token_id,
        "im_end": cfg.im_end_token_id,
        "system": cfg.system_token_id,
        "user": cfg.user_token_id,
        "assistant": cfg.assistant_token_id,
        "newline": one("\n"),
        "audio_start": one(tok.audio_bos_token),
        "audio_end": one(tok.audio_eos_token),
        "vision_start": one(tok.vision_bos_token),
        "vision_end": one(tok.vision_eos_token),
        "eos": eos,
    }


def _suppressed(tokenizer, vocab: int, eos: set[int]) -> torch.Tensor:
    """Ids a reply never samples: past the tokenizer, and special tokens other than EOS."""
    suppress = torch.zeros(vocab, dtype=torch.bool)
    suppress[len(tokenizer) :] = True
    for tok_id, added in tokenizer.added_tokens_decoder.items():
        if added.special and tok_id < vocab and tok_id not in eos:
            suppress[tok_id] = True
    return suppress


_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render_system(instructions: str, tools: tuple[dict[str, Any], ...]) -> str:
    """The system turn's text as Qwen3's chat template writes it: the instructions, then the
    tools (as the template's function signatures) and how to call them."""
    if not tools:
        return instructions
    lines = [json.dumps({"type": "function", "function": {
        k: v for k, v in tool.items() if k in ("name", "description", "parameters")}})
        for tool in tools]
    head = f"{instructions}\n\n" if instructions else ""
    return head + _TOOLS_HEAD + "\n" + "\n".join(lines) + "\n" + _TOOLS_TAIL
