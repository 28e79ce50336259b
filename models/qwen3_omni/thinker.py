"""The Thinker side of the Qwen3-Omni adapter: each session's chat context, batched forwards over
the slot KV, and reply tokens.

New positions wait in a session as pieces (text, audio or image embeddings with their M-RoPE
positions) until the next forward, which takes every session's pieces at once. A user turn opens
with the first input after a reply and closes at `begin`; input during a reply ends that reply's
text. Every forward hands the Talker the positions it conditions on.

A context's head (the system turn set before any input) is computed once per model version
and token sequence: the first session to forward it stores its KV in the prefix cache, later
ones copy it into their slot instead of computing it.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from models.base import ReplyTurn, TextTurn, ThinkerToken
from models.kv import SlotKV
from models.prefix_cache import PrefixCache
from models.qwen3_omni.encoders import AudioFeatures, VisionFeatures
from models.qwen3_omni.options import Qwen3OmniOptions, sample_rows
from models.qwen3_omni.session import OTHER, PREFIX, USER, Piece, Session
from models.qwen3_omni.talker import Talker
from models.syncs import fetch, upload
from models.tool_forcing import CallForcing, forced_names


class ContextTooLong(ValueError):
    """One input does not fit in the context even after evicting everything evictable."""


class Thinker:
    def __init__(
        self,
        model,
        tokenizer,
        kv: SlotKV,
        talker: Talker,
        options: Qwen3OmniOptions,
        device,
        dtype,
        prefix_cache: PrefixCache,
        version: str,
    ) -> None:
        """`version` identifies the language model's weights (`models.fingerprint`)."""
        self.module = model.thinker
        self.lm = model.thinker.model.language_model
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
        self.prefix_cache, self.version = prefix_cache, version
        self.positions = 0
        """Positions computed by forwards since the Thinker was made (prefix cache hits not)."""

    def start(self, sess: Session) -> None:
        """Open a new session's context with the server's own system prompt, if it has one."""
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
        return CallForcing(names, self._encode, self.ids["im_end"])

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _system_text(self, instructions: str, tools: tuple[dict[str, Any], ...]) -> str:
        return render_system(instructions or self.options.system_prompt or "", tools)

    def _system_turn(self, sess: Session, text: str) -> None:
        """Make `text` the context's system turn: at its head while it holds nothing else
        (never forwarded, so the old head can simply be replaced), else appended here."""
        if text == (sess.system or ""):
            return
        head = sess.next_pos == sess.keep
        if head:
            sess.pending, sess.next_pos, sess.keep, sess.head = [], 0, 0, ()
        sess.system = text
        if not text:
            return
        ids = self.ids
        body = self.tokenizer.encode(text, add_special_tokens=False)
        tokens = [ids["im_start"], ids["system"], ids["newline"], *body, ids["im_end"],
                  ids["newline"]]
        self.push_text(sess, tokens, OTHER)
        if head:
            sess.keep, sess.head = len(tokens), tuple(tokens)

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
            if not isinstance(feat, (AudioFeatures, VisionFeatures, TextTurn, ReplyTurn,
                                     type(None))):
                raise TypeError(f"cannot prefill {type(feat).__name__}")
        ids = self.ids
        rows = []
        for sess, feat in zip(sessions, features, strict=True):
            if feat is None:
                continue
            if isinstance(feat, ReplyTurn):
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
        rows = [sess for sess in rows if self._fits(sess)]
        if rows:
            self.forward(rows)

    def begin(self, sess: Session, instructions: str = "",
              tools: tuple[dict[str, Any], ...] = ()) -> None:
        """Close the user turn and open the assistant's; the previous reply must be ended.
        Instructions (or tools) other than the context's latest system turn come in a system
        turn of their own just before the reply."""
        ids = self.ids
        if sess.turn == "assistant":
            self.close_reply(sess)
        if sess.turn == "user":
            self.close_audio(sess)
            self.push_text(sess, [ids["im_end"], ids["newline"]], USER)
            sess.turn = None
        self._system_turn(sess, self._system_text(instructions, tools))
        self.push_text(sess, [ids["im_start"], ids["assistant"], ids["newline"]], PREFIX)
        sess.turn = "assistant"
        sess.responding, sess.thinker_done = True, False
        sess.token_ids, sess.prefix_offset, sess.read_offset = [], 0, 0
        sess.talker_done = False
        if sess.truncation.type != "disabled":
            sess.full = False
        sess.cached = self.kv.length[sess.thinker_slot] if sess.thinker_slot is not None else 0

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
        """Make room for the session's pending positions as its truncation policy says; False
        when it says not to (`disabled`): the pending input is refused."""
        self._open_slot(sess)
        n = sum(p.embeds.shape[0] for p in sess.pending)
        length, limit, keep = self.kv.length[sess.thinker_slot], self._limit(sess), sess.keep
        if length + n <= limit:
            return True
        policy = sess.truncation
        if policy.type == "disabled":
            sess.pending, sess.full = [], True
            return False
        if n > limit - keep:
            raise ContextTooLong(f"{sess.sid}: {n} new positions, {limit - keep} evictable")
        if policy.type == "retention_ratio":
            target = math.floor(policy.ratio * (limit - keep))
        else:
            target = limit - keep - limit // 4
        drop = min(max(length + n - limit, length - keep - target), length - keep)
        self.kv.evict(sess.thinker_slot, keep, drop)
        sess.dropped += drop
        return True

    def forward(self, sessions: list[Session]) -> torch.Tensor:
        """Every session's pending pieces forwarded -> each row's last hidden state.

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
            return self._forward(sessions)
        deferred = {id(sess) for sess in later}
        first = [sess for sess in sessions if id(sess) not in deferred]
        rows = torch.cat([self._forward(first), self._forward(later)])
        order = {id(sess): i for i, sess in enumerate(first + later)}
        return rows[torch.tensor([order[id(sess)] for sess in sessions], device=rows.device)]

    def _forward(self, sessions: list[Session]) -> torch.Tensor:
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
        accept = self.talker.accept_layer
        kv = self.kv.bind([s.thinker_slot for s in sessions], [s.sid for s in sessions], new)
        out = self.lm(
            inputs_embeds=embeds,
            attention_mask=kv.mask,
            position_ids=upload(positions, self.device),
            cache=kv,
            use_cache=True,
            visual_pos_masks=upload(visual, self.device, torch.bool) if deep else None,
            deepstack_visual_embeds=[torch.cat(layer) for layer in deep] if deep else None,
            output_hidden_states=[accept] if capture else False,
        )
        kv.commit()
        for sess in heads:
            prefix = (self.version, sess.head)
            if self.prefix_cache.keep(prefix, self.kv.read(sess.thinker_slot, sess.keep)):
                sess.prefix = prefix
        for sess in sessions:
            sess.pending, sess.head = [], ()
        accepted = out.hidden_states[accept] if capture else None
        self.talker.take_context(sessions, embeds, accepted, role, multimodal & (role == USER))
        last = upload([n - 1 for n in new], self.device)
        return out.last_hidden_state[torch.arange(batch, device=self.device), last]

    def _open_slot(self, sess: Session) -> None:
        if sess.thinker_slot is None:
            sess.thinker_slot = self.kv.acquire(sess.sid)

    def _open_head(self, sess: Session) -> bool:
        """True when the session's head is still to be computed (and then kept in the prefix
        cache); a head the cache holds is copied into the session's slot instead."""
        self._open_slot(sess)
        if not sess.head or sess.prefix is not None:
            return False
        prefix = (self.version, sess.head)
        cached = self.prefix_cache.take(prefix)
        if cached is None:
            return True
        self.kv.write(sess.thinker_slot, cached)
        sess.prefix = prefix
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
            for sess in [s for s in active if s.full or not self._fits(s)]:
                sess.thinker_done = True
                results[id(sess)] = ThinkerToken("", None, True, reason="context_length_exceeded")
            active = [s for s in active if id(s) not in results]
        if active:
            embed = self.module.get_input_embeddings()
            # A reply's first step forwards the assistant prefix, the others one position:
            # apart, no row is padded to the prefix; they meet again to sample.
            steps = [s for s in active if sum(p.embeds.shape[0] for p in s.pending) == 1]
            active = steps + [s for s in active if id(s) not in {id(t) for t in steps}]
            groups = (steps, active[len(steps):])
            last = torch.cat([self.forward(group) for group in groups if group])
            logits = self.module.lm_head(last).float()
            raw = logits.clone() if any(s.forcing for s in active) else logits
            logits.masked_fill_(self.suppress, -math.inf)
            opts = self.options
            no_eos = [len(s.token_ids) < opts.min_text_tokens for s in active]
            for b, sess in enumerate(active):
                if sess.forcing is not None:
                    # The call's own constraint decides where it ends, whatever the length.
                    no_eos[b] = self._constrain(logits, raw, b, sess)
            if any(no_eos):
                rows = upload(no_eos, self.device, torch.bool)
                logits.masked_fill_(rows[:, None] & self.eos, -math.inf)
            base = opts.thinker_sampling
            samplings = [base if s.temperature is None else replace(base, temperature=s.temperature)
                         for s in active]
            tokens = sample_rows(logits, samplings, [s.thinker_gen for s in active])
            conditioning = self.talker.conditioning(embed(tokens))
            for b, (sess, tok) in enumerate(zip(active, fetch(tokens).tolist(), strict=True)):
                if sess.forcing is not None:
                    sess.forcing.advance(tok, self.tokenizer.decode([tok]))
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
                results[id(sess)] = ThinkerToken(
                    self._detokenize(sess), conditioning[b], sess.thinker_done, tok, usage
                )
        return [results.get(id(s), ThinkerToken("", None, True)) for s in sessions]

    def _constrain(self, logits: torch.Tensor, raw: torch.Tensor, b: int, sess: Session) -> bool:
        """Row `b` keeps only the tokens the reply's forced call allows, with the model's own
        scores (so sampling still chooses among tool names), the suppressed ones included:
        a forced token is the template's, even where free text may not write it. True when
        the row's arguments are free but its turn may not end yet (no EOS)."""
        allowed = sess.forcing.allowed(sess.budget - len(sess.token_ids))
        if allowed is None:
            # Free arguments, but the turn does not end before the call does.
            return True
        keep = upload(allowed, logits.device)
        logits[b] = -math.inf
        logits[b].index_copy_(0, keep, raw[b].index_select(0, keep))
        return False

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
