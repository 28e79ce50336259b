"""Moshi behind `DuplexModel`.

Moshi is one transformer stepping at Mimi's 12.5 Hz over three streams at once: a text token,
Moshi's own Q audio codes and the user's Q audio codes. Mapped onto the stage calls:

- `encode_audio`: one 1920-sample chunk at 24 kHz -> the user's Q codes for that frame
  (streaming Mimi encode, carried per session).
- `thinker_prefill`: while listening, every user frame is one position of the main decoder, with
  the text stream at its pad token and Moshi's audio at the "no audio" id. While responding,
  user frames wait in a per-session queue: each decode step consumes one (or silence if none
  waits), since a Moshi position always carries the user frame of the same instant. Frames
  still queued when a response ends go into the context at the next prefill.
- `thinker_decode`: one position of the main decoder -> one text token and the hidden state the
  depth decoder conditions on.
- `talker_step`: the depth decoder samples Moshi's Q codes for that position (greedy).
  Codebooks 1..Q-1 run one step behind codebook 0 (transformers' delay pattern, on both audio
  streams), so the frame emitted at step t is (codebook 0 of step t-1, codebooks 1.. of step t):
  the first step of a response emits no frame.
- `codec_decode`: `MimiStreamDecoder`, exact streaming with carried conv and attention state.

A response ends after `max_response_frames` positions, or when the text stream emits EOS at or
after `min_response_frames` (EOS is masked before that: random weights would emit it at once).
Each Thinker step must be followed by its `talker_step` before the next `thinker_decode`,
because Moshi's next position embeds the codes the depth decoder produced.

Batching across sessions: every session keeps its own KV buffer (`models.kv.SlidingKV`,
time-ordered, with its own length). A batched call appends each session's new positions at that
session's own length and attends over a key axis as wide as the longest session; the mask hides
the right padding of shorter sessions (and positions beyond `config.sliding_window`, which is
how long sessions stay bounded). Rotary positions are per session. A prefill whose sessions bring
different numbers of frames pads the shorter ones and commits only their real positions. The
codec decoder batches sessions with the same number of frames; sessions whose chunks differ in
length go in one forward per length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.moshi.modeling_moshi import apply_rotary_pos_emb

from models.base import (
    DuplexFrame,
    DuplexModel,
    ModelState,
    OfflineCodec,
    StageTimer,
    TalkerFrame,
    ThinkerToken,
    untimed,
)
from models.kv import KVBatch, SlidingKV, StepKV, tensor_bytes
from models.moshi import duplex, tiny
from models.moshi.mimi_stream import MimiStreamDecoder, MimiStreamEncoder
from models.reply import ReplySpec
from models.syncs import fetch, upload


@dataclass(frozen=True)
class MoshiConditioning:
    """What the depth decoder needs from one main-decoder position."""

    hidden: torch.Tensor
    text_id: int


@dataclass
class _Turn:
    """Per-session stream positions that are not KV: delayed codebooks, the reply's progress."""

    # Codebooks 1.. of the last user frame: they enter the main decoder one position late.
    user_tail: torch.Tensor
    # The last depth step's codes, still in the delayed layout the next position embeds.
    moshi_in: torch.Tensor
    # User frames heard while responding: each waits for the decode step of its instant.
    pending: list[torch.Tensor] = field(default_factory=list)
    responding: bool = False
    frames: int = 0
    text_in: int = 0
    # Codebook 0 of a frame whose codebooks 1.. come from the next depth step.
    pending_cb0: torch.Tensor | None = None
    awaiting_talker: bool = False

    @property
    def nbytes(self) -> int:
        return tensor_bytes([self.user_tail, self.moshi_in, self.pending_cb0, self.pending])

    def release(self) -> None:
        self.pending = []
        self.pending_cb0 = None
        self.user_tail = self.user_tail.new_empty(0)
        self.moshi_in = self.moshi_in.new_empty(0)


def _layers_step(
    layers: nn.ModuleList,
    hidden: torch.Tensor,
    batch: KVBatch | StepKV,
    codebook: int | None = None,
) -> torch.Tensor:
    """`MoshiDecoderLayer`s over (B, n, H) new positions with the KV of `batch`.

    With `codebook`, the layers' per-codebook (flexible) weights are that codebook's: one
    `F.linear` on its slice instead of transformers' select, transpose and batched matmul, which
    on a tiny depth decoder cost more than the arithmetic."""

    def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if codebook is None:
            return module(x)
        weight = module.linear.weight if hasattr(module, "linear") else module.weight
        return F.linear(x, weight[codebook])

    rotary = layers[0].self_attn.rotary_emb
    rope = None if rotary is None else rotary(hidden, batch.position_ids)
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        shape = (*x.shape[:2], -1, attn.head_dim)
        q = project(attn.q_proj, x).view(shape).transpose(1, 2)
        k = project(attn.k_proj, x).view(shape).transpose(1, 2)
        v = project(attn.v_proj, x).view(shape).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary_pos_emb(q, k, *rope)
        out = batch.attend(index, q, k, v, attn.scaling).transpose(1, 2).reshape(*x.shape[:2], -1)
        hidden = hidden + project(attn.o_proj, out)
        x = layer.post_attention_layernorm(hidden)
        if codebook is None:
            hidden = hidden + layer.mlp(x)
        else:
            # `MoshiGatingMLP`: fc1 gives the gate and the value side by side.
            gate, value = project(layer.mlp.fc1, x).view(*x.shape[:2], 2, -1).unbind(2)
            hidden = hidden + project(layer.mlp.fc2, layer.mlp.activation_fn(gate) * value)
    return hidden


class MoshiAdapter(DuplexModel):
    name = "moshi"
    # Each decode step needs its depth-decoded audio codes before the next one.
    max_thinker_lead = 1
    duplex_delay_frames = duplex.DUPLEX_DELAY_FRAMES

    def __init__(
        self,
        model: nn.Module,
        *,
        detokenize: Callable[[int], str] | None = None,
        min_response_frames: int = 4,
        max_response_frames: int = 125,
    ):
        self.model = model.eval()
        config = model.config
        self.config = config
        self.num_codebooks = config.num_codebooks
        mimi = model.audio_encoder
        self.encoder = MimiStreamEncoder(mimi, num_quantizers=self.num_codebooks)
        self.decoder = MimiStreamDecoder(mimi)
        self.input_rate = self.output_rate = int(mimi.config.sampling_rate)
        self.input_chunk_samples = self.frame_samples = int(mimi.config.frame_size)
        param = next(model.parameters())
        self._device, self._dtype = param.device, param.dtype
        self.device = str(param.device)
        self.dtype = str(param.dtype).removeprefix("torch.")
        self.detokenize = detokenize or (lambda token: "")
        self.min_response_frames = min_response_frames
        self.max_response_frames = max_response_frames
        # Ids past the real vocabularies have their own embedding rows: transformers starts text
        # with `vocab_size` and marks "no audio" (and the delayed codebooks' start) with
        # `audio_vocab_size`.
        self.audio_none = config.audio_vocab_size
        self.text_start = config.vocab_size
        self.text_pad = (
            config.pad_token_id if config.pad_token_id is not None else config.vocab_size
        )
        eos = config.eos_token_id
        self.eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        # On the device once: a step masks with it instead of indexing by a list of ids.
        self._eos = torch.zeros(config.vocab_size, dtype=torch.bool)
        self._eos[self.eos_ids] = True
        self._eos = self._eos.to(self._device)
        with torch.inference_mode():
            silence = torch.zeros(1, 1, self.frame_samples, dtype=self._dtype, device=self._device)
            codes = mimi.encode(silence, num_quantizers=self.num_codebooks).audio_codes
        self.silence = codes[0, :, 0]

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str = "cpu", dtype: str = "float32", **options
    ) -> MoshiAdapter:
        model = tiny.load(path, device, dtype)
        return cls(model, detokenize=tiny.text_detokenizer(path, model.config), **options)

    def new_state(self, session_id: str) -> ModelState:
        config = self.config
        # transformers' Moshi attends to the whole past; the original keeps a context of
        # `sliding_window` (3000) positions. Using it as the window matches transformers up to
        # that length and keeps long sessions bounded past it.
        kv = SlidingKV(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            config.sliding_window,
            dtype=self._dtype,
            device=self._device,
        )
        turn = _Turn(
            user_tail=self._codes(self.audio_none, self.num_codebooks - 1),
            moshi_in=self._codes(self.audio_none, self.num_codebooks),
        )
        slots = {
            "encoder": self.encoder.new_state(),
            "thinker": kv,
            "decoder": self.decoder.new_state(),
            "turn": turn,
        }
        return ModelState(session_id, slots)

    def _codes(self, value: int, count: int) -> torch.Tensor:
        return torch.full((count,), value, dtype=torch.long, device=self._device)

    def reset_response(self, state: ModelState) -> None:
        self._end_response(state.slots["turn"])
        self._fresh_decoder(state)

    def _end_response(self, turn: _Turn) -> None:
        turn.responding = False
        turn.awaiting_talker = False
        turn.pending_cb0 = None
        turn.moshi_in = self._codes(self.audio_none, self.num_codebooks)

    def _fresh_decoder(self, state: ModelState) -> None:
        state.slots["decoder"].release()
        state.slots["decoder"] = self.decoder.new_state()

    def offline_codec(self) -> OfflineCodec:
        mimi = self.model.audio_encoder
        return OfflineCodec(self.num_codebooks, mimi.config.codebook_size, 0, self._decode_offline)

    @torch.inference_mode()
    def _decode_offline(self, codes: np.ndarray) -> np.ndarray:
        codes = torch.as_tensor(codes, dtype=torch.long, device=self._device)
        return self.model.audio_encoder.decode(codes).audio_values[:, 0].float().cpu().numpy()

    def encode_audio(self, states: list[ModelState], chunks: list[np.ndarray]) -> list[np.ndarray]:
        for chunk in chunks:
            if len(chunk) != self.input_chunk_samples:
                raise ValueError(f"chunks must hold {self.input_chunk_samples} samples")
        audio = upload(np.stack(chunks), self._device, self._dtype)[:, None]
        codes = self.encoder.encode([s.slots["encoder"] for s in states], audio)
        return list(fetch(codes))

    def _embed(self, text: torch.Tensor, moshi: torch.Tensor, user: torch.Tensor) -> torch.Tensor:
        """text (B, n), moshi and user codes (B, Q, n) -> (B, n, H), summed as transformers does."""
        codes = torch.cat([moshi, user], dim=1)
        audio = sum(table(codes[:, i]) for i, table in enumerate(self.model.embed_tokens))
        return audio + self.model.decoder.model.embed_tokens(text)

    def _delay_user(self, turn: _Turn, frames: torch.Tensor) -> torch.Tensor:
        """(Q, T) user frames -> the delayed layout the main decoder reads, advancing the tail."""
        delayed = torch.cat([turn.user_tail[:, None], frames[1:]], dim=1)[:, : frames.shape[1]]
        turn.user_tail = frames[1:, -1].clone()
        return torch.cat([frames[:1], delayed], dim=0)

    def _main_step(self, states: list[ModelState], embeds: torch.Tensor, counts=None):
        batch = KVBatch([s.slots["thinker"] for s in states], embeds.shape[1])
        hidden = _layers_step(self.model.decoder.model.layers, embeds, batch)
        batch.commit(counts)
        return hidden

    @torch.inference_mode()
    def thinker_prefill(self, states: list[ModelState], features: list[np.ndarray]) -> None:
        listening = []
        for state, codes in zip(states, features, strict=True):
            turn = state.slots["turn"]
            frames = torch.as_tensor(codes, dtype=torch.long, device=self._device)
            turn.pending.extend(frames.unbind(1))
            if not turn.responding and turn.pending:
                listening.append(state)
        if not listening:
            return
        counts = [len(s.slots["turn"].pending) for s in listening]
        width = max(counts)
        rows = []
        for state in listening:
            turn = state.slots["turn"]
            user = self._delay_user(turn, torch.stack(turn.pending, dim=1))
            turn.pending = []
            rows.append(nn.functional.pad(user, (0, width - user.shape[1]), value=self.audio_none))
        user = torch.stack(rows)
        text = torch.full((len(rows), width), self.text_pad, dtype=torch.long, device=self._device)
        moshi = torch.full_like(user, self.audio_none)
        self._main_step(listening, self._embed(text, moshi, user), counts)

    def begin_response(self, state: ModelState, spec: ReplySpec | None = None) -> None:
        turn = state.slots["turn"]
        self._end_response(turn)
        turn.responding = True
        turn.frames = 0
        turn.text_in = self.text_start
        self._fresh_decoder(state)

    @torch.inference_mode()
    def thinker_decode(self, states: list[ModelState]) -> list[ThinkerToken]:
        turns = [s.slots["turn"] for s in states]
        for state, turn in zip(states, turns, strict=True):
            if not turn.responding or turn.awaiting_talker:
                raise RuntimeError(
                    f"session {state.session_id}: thinker_decode needs begin_response and, "
                    "after each decode, its talker_step"
                )
        text = upload([[t.text_in] for t in turns], self._device)
        moshi = torch.stack([t.moshi_in for t in turns])[:, :, None]
        user = torch.stack(
            [
                self._delay_user(t, (t.pending.pop(0) if t.pending else self.silence)[:, None])
                for t in turns
            ]
        )
        hidden = self._main_step(states, self._embed(text, moshi, user))
        hidden = self.model.decoder.model.norm(hidden)[:, -1]
        logits = self.model.decoder.lm_head(hidden)
        early = [t.frames + 1 < self.min_response_frames for t in turns]
        if self.eos_ids and any(early):
            rows = upload(early, self._device, torch.bool)
            logits.masked_fill_(rows[:, None] & self._eos, float("-inf"))
        tokens = []
        ids = fetch(logits.argmax(-1)).tolist()
        for row, (turn, token) in enumerate(zip(turns, ids, strict=True)):
            turn.frames += 1
            turn.text_in = token
            turn.awaiting_talker = True
            finished = token in self.eos_ids or turn.frames >= self.max_response_frames
            conditioning = MoshiConditioning(hidden[row], token)
            tokens.append(ThinkerToken(self.detokenize(token), conditioning, finished))
        return tokens

    @torch.inference_mode()
    def talker_step(
        self, states: list[ModelState], tokens: list[ThinkerToken | None]
    ) -> list[TalkerFrame]:
        # No token: nothing to do yet. A token whose response was reset since: that reply is over.
        frames = [TalkerFrame(None, token is not None) for token in tokens]
        rows = [
            i
            for i, (state, token) in enumerate(zip(states, tokens, strict=True))
            if token is not None and state.slots["turn"].awaiting_talker
        ]
        if not rows:
            return frames
        hidden = torch.stack([tokens[i].conditioning.hidden for i in rows])[:, None]
        text = upload([tokens[i].conditioning.text_id for i in rows], self._device)
        generated = self._depth(hidden, text)
        # Each frame voices codebook 0 of the step before with the others of this one; all
        # rows' frames come back in one read.
        held = [states[i].slots["turn"].pending_cb0 is not None for i in rows]
        voiced = [torch.cat([states[i].slots["turn"].pending_cb0[None], codes[1:]])
                  for i, codes, h in zip(rows, generated, held, strict=True) if h]
        out = iter(fetch(torch.stack(voiced)) if voiced else ())
        for i, codes, h in zip(rows, generated, held, strict=True):
            turn = states[i].slots["turn"]
            frame = next(out) if h else None
            turn.pending_cb0 = codes[0].clone()
            turn.moshi_in = codes.clone()
            turn.awaiting_talker = False
            if tokens[i].finished:
                self._end_response(turn)
            frames[i] = TalkerFrame(frame, tokens[i].finished)
        return frames

    def _depth(self, hidden: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Greedy depth decoding: hidden (B, 1, H), text ids (B,) -> codes (B, Q)."""
        depth = self.model.depth_decoder
        kv = StepKV(len(depth.layers))
        previous = text[:, None]
        codes = []
        for codebook in range(self.num_codebooks):
            table = depth.text_embed_tokens if codebook == 0 else depth.embed_tokens[codebook - 1]
            embeds = table(previous) + F.linear(hidden, depth.input_projections.weight[codebook])
            out = _layers_step(depth.layers, embeds, kv, codebook)
            previous = F.linear(out, depth.lm_heads.weight[codebook]).argmax(-1)
            codes.append(previous[:, 0])
        return torch.stack(codes, dim=1)

    @torch.inference_mode()
    def codec_decode(self, states: list[ModelState], codes: list[np.ndarray]) -> list[np.ndarray]:
        # A Talker frame is (Q,); longer runs come as (Q, T).
        codes = [c[:, None] if np.ndim(c) == 1 else c for c in map(np.asarray, codes)]
        by_length: dict[int, list[int]] = {}
        for i, frame_codes in enumerate(codes):
            by_length.setdefault(np.shape(frame_codes)[-1], []).append(i)
        pcm: list[np.ndarray] = [np.zeros(0, np.float32)] * len(codes)
        for rows in by_length.values():
            batch = torch.stack([torch.as_tensor(np.asarray(codes[i])) for i in rows])
            audio = self.decoder.decode(
                [states[i].slots["decoder"] for i in rows], batch.to(self._device, torch.long)
            )
            decoded = fetch(audio[:, 0].float())
            for row, i in enumerate(rows):
                pcm[i] = decoded[row]
        return pcm

    def duplex_step(
        self, states: list[ModelState], frames: list[np.ndarray], timer: StageTimer = untimed
    ) -> list[DuplexFrame]:
        return duplex.duplex_step(self, states, frames, timer)
