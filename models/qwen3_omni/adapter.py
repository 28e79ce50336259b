"""Qwen3-Omni behind `DuplexModel`, every stage batched across sessions in one forward.

Thinker and Talker KV live in slot pools (`SlotKV`): one buffer per layer with a row per session
and a length per row. A call writes each row's new keys at that row's own length and attends
under an explicit 4D mask with explicit (M-RoPE) positions, so sessions whose contexts differ in
length share one forward with no copying of their past. Each slot records its owner and every
call checks it, so a reused slot can never feed one session's context to another.

The Talker is fed as `Qwen3OmniMoeForConditionalGeneration.generate` feeds it, made incremental:
the user turns' Thinker states (projected) and the assistant prefix are its prefill, and after
that each step consumes one codec frame plus one Thinker token (or tts_eos, then tts_pad).
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache, WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

from models.base import DuplexModel, ModelState, TalkerFrame, ThinkerToken
from models.qwen3_omni.codec import Code2WavPool, StreamingCode2Wav
from models.qwen3_omni.tiny import load, load_options, load_preprocessor, load_tokenizer

STATE_KEY = "qwen3_omni"
OUTPUT_RATE = 24000

_OTHER, _USER, _PREFIX = 0, 1, 2
"""Role of a Thinker position for the Talker: none, user-turn context, assistant prefix."""


class SlotOwnershipError(RuntimeError):
    """A state reached a slot that another session owns now; nothing was computed."""


class ContextTooLong(ValueError):
    """One input does not fit in the context even after evicting everything evictable."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class Qwen3OmniOptions:
    min_text_tokens: int = 1
    max_text_tokens: int = 512
    min_frames: int = 1
    max_frames: int = 1500
    thinker_sampling: Sampling = Sampling()
    # generate()'s Talker defaults; its code predictor samples with top_k 50, top_p 0.8.
    talker_sampling: Sampling = Sampling(0.9, 50, 1.0)
    residual_sampling: Sampling = Sampling(1.0, 50, 0.8)
    seed: int = 0
    speaker: str = "ethan"
    system_prompt: str | None = None
    max_context: int = 8192
    """Thinker positions kept per session. Past it the oldest positions after the system prompt
    are evicted, a quarter of the context at a time, so a long call keeps going instead of
    failing when a buffer fills."""
    talker_context: int = 512
    """User-turn positions the Talker is prefilled with at each reply (generate uses all)."""
    audio_chunk_samples: int | None = None
    """None: one conv chunk of the audio tower (n_window * 2 mel frames, 1 s), so a chunk sees
    exactly the convolution input it would see offline."""
    video_max_pixels: int = 448 * 448


@dataclass(frozen=True)
class AudioFeatures:
    embeds: torch.Tensor
    """(n, thinker hidden): audio tower output, placed directly at the audio positions."""


@dataclass(frozen=True)
class VisionFeatures:
    embeds: torch.Tensor
    """(n, thinker hidden): merged patch features of one frame."""
    deepstack: tuple[torch.Tensor, ...]
    """Per deepstack layer (n, thinker hidden), added to the hidden states of the first layers."""
    grid: tuple[int, int]
    """Merged grid (h, w); n == h * w."""


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple, deque)):
        return sum(_nbytes(x) for x in obj)
    return 0


class SlotKV:
    """KV of many sessions in one buffer per layer: (slots, kv_heads, capacity, head_dim).

    Rows are claimed per session and released whole; when rows at the end or the longest
    context go away the buffers shrink, and an empty pool holds no memory at all.
    """

    def __init__(self, layers: int, heads: int, head_dim: int, device, dtype) -> None:
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.device, self.dtype = device, dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.owner: list[str | None] = []
        self.length: list[int] = []
        self.capacity = 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.keys) + _nbytes(self.values)

    def slot_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.heads * self.capacity * self.head_dim * itemsize

    def acquire(self, owner: str) -> int:
        if None in self.owner:
            slot = self.owner.index(None)
        else:
            slot = len(self.owner)
            self._resize(max(1, 2 * len(self.owner)), self.capacity)
        self.owner[slot] = owner
        self.length[slot] = 0
        return slot

    def release(self, slot: int, owner: str) -> None:
        self.check(slot, owner)
        self.owner[slot] = None
        self.length[slot] = 0
        used = [i for i, o in enumerate(self.owner) if o is not None]
        if not used:
            self.keys, self.values, self.owner, self.length, self.capacity = [], [], [], [], 0
            return
        rows = used[-1] + 1
        capacity = _round_up(max(self.length[i] for i in used))
        if rows < len(self.owner) or capacity < self.capacity // 2:
            self._resize(rows, capacity)

    def check(self, slot: int, owner: str) -> None:
        if slot >= len(self.owner) or self.owner[slot] != owner:
            held = self.owner[slot] if slot < len(self.owner) else None
            raise SlotOwnershipError(f"slot {slot} belongs to {held!r}, not {owner!r}")

    def evict(self, slot: int, keep: int, drop: int) -> None:
        """Remove `drop` positions after the first `keep`; later keys keep their rotary phase."""
        end = self.length[slot]
        for buf in (*self.keys, *self.values):
            buf[slot, :, keep : end - drop] = buf[slot, :, keep + drop : end].clone()
        self.length[slot] = end - drop

    def _resize(self, rows: int, capacity: int) -> None:
        shape = (rows, self.heads, capacity, self.head_dim)
        old_rows = min(rows, len(self.owner))
        old_cap = min(capacity, self.capacity)
        for bufs in (self.keys, self.values):
            for i in range(self.layers):
                new = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if i < len(bufs):
                    new[:old_rows, :, :old_cap] = bufs[i][:old_rows, :, :old_cap]
                    bufs[i] = new
                else:
                    bufs.append(new)
        self.owner = (self.owner + [None] * rows)[:rows]
        self.length = (self.length + [0] * rows)[:rows]
        self.capacity = capacity

    def bind(self, slots: list[int], owners: list[str], new: list[int]) -> _BoundKV:
        """Prepare one forward: row b appends `new[b]` positions to slot `slots[b]`."""
        for slot, owner in zip(slots, owners, strict=True):
            self.check(slot, owner)
        q = max(new)
        need = max(self.length[s] for s in slots) + q
        if need > self.capacity:
            self._resize(len(self.owner), max(_round_up(need), 2 * self.capacity))
        return _BoundKV(self, slots, new, q)


def _round_up(n: int, step: int = 64) -> int:
    return max(step, -(-n // step) * step)


class _BoundKV:
    """The `cache=` object of one forward: per-row writes, reads up to the longest row."""

    def __init__(self, pool: SlotKV, slots: list[int], new: list[int], q: int) -> None:
        self.pool, self.slots, self.new = pool, slots, new
        device = pool.device
        starts = torch.tensor([pool.length[s] for s in slots], device=device)
        self.rows = torch.tensor(slots, device=device)[:, None].expand(-1, q)
        self.positions = starts[:, None] + torch.arange(q, device=device)
        self.kv_len = max(pool.length[s] for s in slots) + q
        first = slots[0]
        # Rows in ascending adjacent slots read the pool as a view; others gather a copy.
        self.span = (
            (first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None
        )
        kv_index = torch.arange(self.kv_len, device=device)
        allowed = kv_index[None, None, :] <= self.positions[:, :, None]
        self.mask = torch.zeros(allowed.shape, device=device, dtype=pool.dtype)
        self.mask.masked_fill_(~allowed, torch.finfo(pool.dtype).min)
        self.mask = self.mask[:, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        keys[self.rows, :, self.positions] = key.transpose(1, 2).to(keys.dtype)
        values[self.rows, :, self.positions] = value.transpose(1, 2).to(values.dtype)
        if self.span is not None:
            lo, hi = self.span
            return keys[lo:hi, :, : self.kv_len], values[lo:hi, :, : self.kv_len]
        index = self.rows[:, 0]
        return keys[index, :, : self.kv_len], values[index, :, : self.kv_len]

    def commit(self) -> None:
        for slot, n in zip(self.slots, self.new, strict=True):
            self.pool.length[slot] += n


@dataclass
class _Piece:
    """Consecutive Thinker positions of one kind, waiting for the next forward."""

    embeds: torch.Tensor
    positions: torch.Tensor
    """(3, n) M-RoPE positions (temporal, height, width), on the host: a batch's index
    tensors are assembled there and cross to the device once."""
    role: int
    multimodal: bool = False
    deepstack: tuple[torch.Tensor, ...] | None = None


@dataclass
class _Session:
    sid: str
    thinker_gen: torch.Generator
    talker_gen: torch.Generator
    thinker_slot: int | None = None
    keep: int = 0
    """Leading Thinker positions (the system prompt) that eviction never drops."""
    next_pos: int = 0
    turn: str | None = None
    audio_open: bool = False
    pending: list[_Piece] = field(default_factory=list)
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

    def tensors(self) -> list[Any]:
        pieces = [(p.embeds, p.positions, p.deepstack or ()) for p in self.pending]
        return [
            pieces,
            self.talker_ctx,
            self.talker_prefix,
            self.text_queue,
            self.last_codes,
        ]


class Qwen3OmniAdapter(DuplexModel):
    """Qwen3-Omni (tiny or full) serving many sessions, one forward per stage call.

    Payloads: `encode_audio` returns `AudioFeatures`, `encode_video` `VisionFeatures`;
    `thinker_prefill` takes those, text, or None. A user turn opens with the first input after
    a reply and closes at `begin_response`; input during a reply ends that reply's text.
    `ThinkerToken.conditioning` is the token's Talker-space embedding, `TalkerFrame.codes` a
    (Q,) int64 tensor on the model's device.
    """

    name = "qwen3-omni"
    supports_video = True
    accepts_text = True
    input_rate = 16000
    output_rate = OUTPUT_RATE

    def __init__(
        self,
        model,
        tokenizer,
        preprocessor: dict,
        device: str = "cpu",
        dtype: str = "float32",
        options: Qwen3OmniOptions | None = None,
    ) -> None:
        self.device, self.dtype = str(device), str(dtype).removeprefix("torch.")
        self._torch_dtype = getattr(torch, self.dtype)
        self.model = model.to(self.device).eval()
        if model.dtype != self._torch_dtype:
            # Parameters only: the rotary inv_freq buffers must stay float32, in bf16 a phase
            # at position 10^4 would be off by whole turns.
            with torch.no_grad():
                for param in model.parameters():
                    param.data = param.data.to(self._torch_dtype)
        self.tokenizer = tokenizer
        self.options = options or Qwen3OmniOptions()
        self.config = model.config
        thinker_cfg = self.config.thinker_config
        talker_cfg = self.config.talker_config
        self._thinker = model.thinker
        self._lm = model.thinker.model.language_model
        self._talker = model.talker
        self._predictor = model.talker.code_predictor
        self._accept = talker_cfg.accept_hidden_layer
        self._num_codes = talker_cfg.num_code_groups
        self._codebook = self._predictor.config.vocab_size
        self._codec_eos = talker_cfg.codec_eos_token_id
        for part in (self._lm, self._talker.model):
            # Other kernels (flash attention) ignore an arbitrary 4D mask, which batching needs.
            if part.config._attn_implementation not in ("sdpa", "eager"):
                raise ValueError(
                    f"{type(part).__name__} uses {part.config._attn_implementation!r}; "
                    "load with attn_implementation='sdpa'"
                )

        self._features = WhisperFeatureExtractor(
            **{
                k: preprocessor[k]
                for k in (
                    "feature_size",
                    "sampling_rate",
                    "hop_length",
                    "n_fft",
                    "chunk_length",
                    "padding_value",
                    "dither",
                )
                if k in preprocessor
            },
            return_attention_mask=True,
        )
        audio_cfg = thinker_cfg.audio_config
        self._n_window = audio_cfg.n_window
        self.input_chunk_samples = self.options.audio_chunk_samples or (
            2 * audio_cfg.n_window * self._features.hop_length
        )
        vision_cfg = thinker_cfg.vision_config
        self._patch = vision_cfg.patch_size
        self._merge = vision_cfg.spatial_merge_size
        self._temporal_patch = vision_cfg.temporal_patch_size
        self._image_mean = torch.tensor(preprocessor["image_mean"], device=self.device)
        self._image_std = torch.tensor(preprocessor["image_std"], device=self.device)

        self._codec = StreamingCode2Wav(model.code2wav)
        self._codec_pool = Code2WavPool(self._codec)
        self.frame_samples = self._codec.frame_samples

        text_cfg = thinker_cfg.text_config
        head_dim = (
            getattr(text_cfg, "head_dim", None)
            or text_cfg.hidden_size // text_cfg.num_attention_heads
        )
        self._thinker_kv = SlotKV(
            text_cfg.num_hidden_layers,
            text_cfg.num_key_value_heads,
            head_dim,
            self.device,
            self._torch_dtype,
        )
        ttext = talker_cfg.text_config
        t_head = getattr(ttext, "head_dim", None) or ttext.hidden_size // ttext.num_attention_heads
        self._talker_kv = SlotKV(
            ttext.num_hidden_layers,
            ttext.num_key_value_heads,
            t_head,
            self.device,
            self._torch_dtype,
        )

        self._ids = self._token_ids()
        self._eos_ids = sorted(self._ids["eos"])
        vocab = text_cfg.vocab_size
        suppress = torch.zeros(vocab, dtype=torch.bool)
        suppress[len(tokenizer) :] = True
        for tok_id, added in tokenizer.added_tokens_decoder.items():
            if added.special and tok_id < vocab and tok_id not in self._ids["eos"]:
                suppress[tok_id] = True
        self._thinker_suppress = suppress.to(self.device)
        codec_allowed = torch.zeros(ttext.vocab_size, dtype=torch.bool)
        codec_allowed[: self._codebook] = True
        codec_allowed[self._codec_eos] = True
        self._codec_suppress = (~codec_allowed).to(self.device)

        speaker = self.options.speaker.lower()
        if speaker not in talker_cfg.speaker_id:
            raise ValueError(f"unknown speaker {speaker!r}; have {sorted(talker_cfg.speaker_id)}")
        with torch.inference_mode():
            special = torch.tensor(
                [
                    self.config.tts_bos_token_id,
                    self.config.tts_eos_token_id,
                    self.config.tts_pad_token_id,
                ],
                device=self.device,
            )
            tts = self._talker.text_projection(self._thinker.get_input_embeddings()(special))
            self._tts_bos, self._tts_eos, self._tts_pad = tts.unbind(0)
            codec_prefix = torch.tensor(
                [
                    talker_cfg.codec_nothink_id,
                    talker_cfg.codec_think_bos_id,
                    talker_cfg.codec_think_eos_id,
                    talker_cfg.speaker_id[speaker],
                    talker_cfg.codec_pad_id,
                    talker_cfg.codec_bos_id,
                ],
                device=self.device,
            )
            codec_part = self._talker.get_input_embeddings()(codec_prefix)
            text_part = torch.stack([self._tts_pad] * 4 + [self._tts_bos])
            # Positions 3..7 of generate's assistant prefix; 0..2 and 8 depend on the reply.
            self._assistant_middle = text_part + codec_part[:5]
            self._codec_bos = codec_part[5]

    @classmethod
    def from_pretrained(
        cls,
        path,
        device: str = "cpu",
        dtype: str = "float32",
        options: Qwen3OmniOptions | None = None,
    ) -> Qwen3OmniAdapter:
        """Without `options`, the checkpoint's duplex_options.json (if any) over the defaults."""
        model = load(path, device, dtype)
        options = options or Qwen3OmniOptions(**load_options(path))
        return cls(
            model,
            load_tokenizer(path),
            load_preprocessor(path, model.config),
            device,
            dtype,
            options,
        )

    def _token_ids(self) -> dict[str, Any]:
        tok, cfg = self.tokenizer, self.config

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

    # ---- per-session state -------------------------------------------------------------------

    def new_state(self, session_id: str) -> ModelState:
        seed = (zlib.crc32(session_id.encode()) ^ self.options.seed) & 0x7FFFFFFF
        sess = _Session(
            session_id,
            torch.Generator(device=self.device).manual_seed(seed),
            torch.Generator(device=self.device).manual_seed(seed ^ 0x5A5A5A5A),
        )
        if self.options.system_prompt:
            ids = self._ids
            text = self.tokenizer.encode(self.options.system_prompt, add_special_tokens=False)
            tokens = [
                ids["im_start"],
                ids["system"],
                ids["newline"],
                *text,
                ids["im_end"],
                ids["newline"],
            ]
            self._push_text(sess, tokens, _OTHER)
            sess.keep = len(tokens)
        state = ModelState(session_id)
        state.slots[STATE_KEY] = sess
        return state

    def _session(self, state: ModelState) -> _Session:
        sess = state.slots.get(STATE_KEY)
        if sess is None:
            raise ValueError(f"session {state.session_id!r} holds no Qwen3-Omni state (freed?)")
        if sess.sid != state.session_id:
            raise SlotOwnershipError(
                f"state of {state.session_id!r} carries {sess.sid!r}'s session"
            )
        return sess

    def _sessions(self, states: list[ModelState]) -> list[_Session]:
        """The batch's sessions, every held slot checked against its owner before any change."""
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a batch must not hold the same state twice")
        sessions = [self._session(s) for s in states]
        for sess in sessions:
            if sess.thinker_slot is not None:
                self._thinker_kv.check(sess.thinker_slot, sess.sid)
            if sess.talker_slot is not None:
                self._talker_kv.check(sess.talker_slot, sess.sid)
        return sessions

    def reset_response(self, state: ModelState) -> None:
        sess = self._session(state)
        if sess.talker_slot is not None:
            self._talker_kv.release(sess.talker_slot, sess.sid)
        if sess.codec_row is not None:
            self._codec_pool.release(sess.codec_row, sess.sid)
        sess.responding, sess.thinker_done = False, True
        sess.talker_slot, sess.talker_pos, sess.codec_row = None, 0, None
        sess.talker_prefix, sess.last_codes = None, None
        sess.text_queue.clear()
        sess.eos_sent, sess.frames, sess.talker_done = False, 0, False

    def free(self, state: ModelState) -> None:
        sess = state.slots.get(STATE_KEY)
        if sess is None:
            return
        self.reset_response(state)
        if sess.thinker_slot is not None:
            self._thinker_kv.release(sess.thinker_slot, sess.sid)
        sess.thinker_slot = None
        sess.pending.clear()
        sess.talker_ctx.clear()
        state.slots.clear()

    def codec_stream_vs_offline(self) -> dict[str, Any]:
        from models.qwen3_omni.codec import measure_stream_vs_offline

        module = self.model.code2wav
        return {
            f"batch_{n}": measure_stream_vs_offline(module, n_frames=50, repeats=3, batch_size=n)
            for n in (1, 8)
        }

    def bytes_held(self, state: ModelState) -> int:
        sess = state.slots.get(STATE_KEY)
        if sess is None:
            return 0
        held = _nbytes(sess.tensors())
        if sess.thinker_slot is not None:
            held += self._thinker_kv.slot_bytes()
        if sess.talker_slot is not None:
            held += self._talker_kv.slot_bytes()
        if sess.codec_row is not None:
            held += self._codec_pool.row_bytes()
        return held

    # ---- encoders ----------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_audio(self, states: list[ModelState], chunks: list[np.ndarray]) -> list[Any]:
        self._sessions(states)
        if not chunks:
            return []
        feats = self._features(
            [np.asarray(c, dtype=np.float32) for c in chunks],
            sampling_rate=self.input_rate,
            padding="longest",
            return_tensors="pt",
            return_attention_mask=True,
        )
        mask = feats["attention_mask"].bool()
        lengths = mask.sum(-1)
        # The tower takes every chunk's frames concatenated in time, with their lengths.
        flat = feats["input_features"].permute(0, 2, 1)[mask].T
        tower = self._thinker.model.audio_tower
        out = tower(
            flat.to(self.device, self._torch_dtype), feature_lens=lengths.to(self.device)
        ).last_hidden_state
        sizes = _get_feat_extract_output_lengths(lengths, self._n_window).tolist()
        return [AudioFeatures(e) for e in out.split(sizes)]

    @torch.inference_mode()
    def encode_video(self, states: list[ModelState], frames: list[np.ndarray]) -> list[Any]:
        self._sessions(states)
        if not frames:
            return []
        patches, grids = zip(*(self._patchify(f) for f in frames), strict=True)
        grid_thw = torch.tensor([[1, h, w] for h, w in grids], device=self.device)
        visual = self._thinker.model.visual
        out = visual(torch.cat(patches).to(self._torch_dtype), grid_thw=grid_thw)
        sizes = [h * w // self._merge**2 for h, w in grids]
        embeds = out.pooler_output.split(sizes)
        deep = [d.split(sizes) for d in out.deepstack_features]
        return [
            VisionFeatures(
                embeds[i],
                tuple(d[i] for d in deep),
                (grids[i][0] // self._merge, grids[i][1] // self._merge),
            )
            for i in range(len(frames))
        ]

    def _patchify(self, frame: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
        """RGB (H, W, 3) uint8 -> Qwen2-VL flat patches (h*w, C*T*P*P) and patch grid (h, w)."""
        factor = self._patch * self._merge
        height, width = frame.shape[:2]
        new_h, new_w = _smart_resize(
            height, width, factor, factor * factor, self.options.video_max_pixels
        )
        image = torch.as_tensor(np.ascontiguousarray(frame), device=self.device)
        image = image.permute(2, 0, 1)[None].float()
        if (new_h, new_w) != (height, width):
            image = F.interpolate(image, (new_h, new_w), mode="bicubic", antialias=True).clamp(
                0, 255
            )
        image = ((image[0] / 255.0) - self._image_mean[:, None, None]) / self._image_std[
            :, None, None
        ]
        p, m, t = self._patch, self._merge, self._temporal_patch
        gh, gw = new_h // p, new_w // p
        x = image.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        # A still frame fills every temporal slot of the patch, as the image processor does.
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)
        return x.reshape(gh * gw, 3 * t * p * p), (gh, gw)

    # ---- Thinker -----------------------------------------------------------------------------

    @torch.inference_mode()
    def _push_text(self, sess: _Session, tokens: list[int], role: int) -> None:
        ids = torch.tensor(tokens, device=self.device)
        embeds = self._thinker.get_input_embeddings()(ids)
        self._push(sess, embeds, role)

    def _push(
        self, sess: _Session, embeds: torch.Tensor, role: int, multimodal: bool = False
    ) -> None:
        n = embeds.shape[0]
        pos = torch.arange(sess.next_pos, sess.next_pos + n).expand(3, -1)
        sess.pending.append(_Piece(embeds, pos, role, multimodal))
        sess.next_pos += n

    def _push_vision(self, sess: _Session, feats: VisionFeatures) -> None:
        h, w = feats.grid
        start = sess.next_pos
        hh = torch.arange(h)[:, None].expand(h, w).flatten()
        ww = torch.arange(w)[None, :].expand(h, w).flatten()
        pos = torch.stack([torch.zeros_like(hh), hh, ww]) + start
        sess.pending.append(_Piece(feats.embeds, pos, _USER, True, feats.deepstack))
        sess.next_pos = start + max(h, w)

    def _close_reply(self, sess: _Session) -> None:
        """End the assistant turn in the Thinker context (its tokens were fed except the last)."""
        ids = self._ids
        tokens = [] if sess.last_token in (None, *ids["eos"]) else [sess.last_token]
        self._push_text(sess, [*tokens, ids["im_end"], ids["newline"]], _OTHER)
        sess.last_token = None
        sess.thinker_done = True
        sess.turn = None

    def _open_user(self, sess: _Session) -> None:
        if sess.turn == "assistant":
            self._close_reply(sess)
        if sess.turn is None:
            ids = self._ids
            self._push_text(sess, [ids["im_start"], ids["user"], ids["newline"]], _USER)
            sess.turn = "user"

    @torch.inference_mode()
    def thinker_prefill(self, states: list[ModelState], features: list[Any]) -> None:
        """Each feature is AudioFeatures, VisionFeatures, text (str) or None (nothing to add).

        New input while a reply is being generated ends that reply's text.
        """
        sessions = self._sessions(states)
        for feat in features:
            if not isinstance(feat, (AudioFeatures, VisionFeatures, str, type(None))):
                raise TypeError(f"cannot prefill {type(feat).__name__}")
        ids = self._ids
        rows = []
        for sess, feat in zip(sessions, features, strict=True):
            if feat is None:
                continue
            self._open_user(sess)
            if isinstance(feat, AudioFeatures):
                if not sess.audio_open:
                    self._push_text(sess, [ids["audio_start"]], _USER)
                    sess.audio_open = True
                self._push(sess, feat.embeds.to(self._torch_dtype), _USER, multimodal=True)
            else:
                self._close_audio(sess)
                if isinstance(feat, VisionFeatures):
                    self._push_text(sess, [ids["vision_start"]], _USER)
                    self._push_vision(sess, feat)
                    self._push_text(sess, [ids["vision_end"]], _USER)
                else:
                    text = self.tokenizer.encode(feat, add_special_tokens=False)
                    self._push_text(sess, text, _USER)
            rows.append(sess)
        if rows:
            self._thinker_forward(rows)

    def _close_audio(self, sess: _Session) -> None:
        if sess.audio_open:
            self._push_text(sess, [self._ids["audio_end"]], _USER)
            sess.audio_open = False

    @torch.inference_mode()
    def begin_response(self, state: ModelState) -> None:
        sess = self._session(state)
        self.reset_response(state)
        ids = self._ids
        if sess.turn == "assistant":
            self._close_reply(sess)
        if sess.turn == "user":
            self._close_audio(sess)
            self._push_text(sess, [ids["im_end"], ids["newline"]], _USER)
        self._push_text(sess, [ids["im_start"], ids["assistant"], ids["newline"]], _PREFIX)
        sess.turn = "assistant"
        sess.responding, sess.thinker_done = True, False
        sess.token_ids, sess.prefix_offset, sess.read_offset = [], 0, 0
        sess.talker_done = False

    def _thinker_forward(self, sessions: list[_Session]) -> torch.Tensor:
        """One forward over every session's pending pieces -> each row's last hidden state."""
        opts = self.options
        pieces = [sess.pending for sess in sessions]
        new = [sum(p.embeds.shape[0] for p in row) for row in pieces]
        for sess, n in zip(sessions, new, strict=True):
            if sess.thinker_slot is None:
                sess.thinker_slot = self._thinker_kv.acquire(sess.sid)
            length = self._thinker_kv.length[sess.thinker_slot]
            if length + n > opts.max_context:
                room = opts.max_context - sess.keep
                if n > room:
                    raise ContextTooLong(f"{sess.sid}: {n} new positions, {room} evictable")
                drop = min(
                    max(length + n - opts.max_context, opts.max_context // 4), length - sess.keep
                )
                self._thinker_kv.evict(sess.thinker_slot, sess.keep, drop)
        q, batch = max(new), len(sessions)
        embeds = torch.nn.utils.rnn.pad_sequence(
            [torch.cat([p.embeds for p in row]) for row in pieces], batch_first=True
        )
        positions = torch.zeros(3, batch, q, dtype=torch.long)
        role = torch.zeros(batch, q, dtype=torch.long)
        multimodal = torch.zeros(batch, q, dtype=torch.bool)
        visual = torch.zeros(batch, q, dtype=torch.bool)
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
        user_mm = multimodal & (role == _USER)
        capture = bool(user_mm.any())
        kv = self._thinker_kv.bind(
            [s.thinker_slot for s in sessions], [s.sid for s in sessions], new
        )
        out = self._lm(
            inputs_embeds=embeds,
            attention_mask=kv.mask,
            position_ids=positions.to(self.device),
            cache=kv,
            use_cache=True,
            visual_pos_masks=visual.to(self.device) if deep else None,
            deepstack_visual_embeds=[torch.cat(layer) for layer in deep] if deep else None,
            output_hidden_states=[self._accept] if capture else False,
        )
        kv.commit()
        for sess in sessions:
            sess.pending = []
        accepted = out.hidden_states[self._accept] if capture else None
        self._update_talker_context(sessions, embeds, accepted, role, multimodal, user_mm)
        last = torch.tensor(new, device=self.device) - 1
        return out.last_hidden_state[torch.arange(batch, device=self.device), last]

    def _update_talker_context(self, sessions, embeds, accepted, role, multimodal, user_mm):
        """Project the user-turn and assistant-prefix positions as generate does for the Talker.

        Text positions go through `text_projection` of their input embedding, audio and image
        positions through `hidden_projection` of the Thinker layer `accept_hidden_layer`.
        """
        user, prefix = role == _USER, role == _PREFIX
        text = (user & ~multimodal) | prefix
        if not bool(user.any() or prefix.any()):
            return
        ctx = torch.zeros(
            *role.shape,
            self._talker.config.text_config.hidden_size,
            device=self.device,
            dtype=self._torch_dtype,
        )
        on_device = self.device
        if bool(text.any()):
            where = text.to(on_device)
            ctx[where] = self._talker.text_projection(embeds[where])
        if bool(user_mm.any()):
            where = user_mm.to(on_device)
            ctx[where] = self._talker.hidden_projection(accepted[where])
        limit = self.options.talker_context
        for b, sess in enumerate(sessions):
            if bool(user[b].any()):
                sess.talker_ctx.append(ctx[b][user[b].to(on_device)])
                total = sum(t.shape[0] for t in sess.talker_ctx)
                if total > limit:
                    sess.talker_ctx = [torch.cat(sess.talker_ctx)[total - limit :]]
            if bool(prefix[b].any()):
                sess.talker_prefix = ctx[b][prefix[b].to(on_device)]

    @torch.inference_mode()
    def thinker_decode(self, states: list[ModelState]) -> list[ThinkerToken]:
        sessions = self._sessions(states)
        active = [s for s in sessions if s.responding and not s.thinker_done]
        results: dict[int, ThinkerToken] = {}
        if active:
            fed = [sess for sess in active if sess.last_token is not None]
            if fed:
                ids = torch.tensor([sess.last_token for sess in fed], device=self.device)
                embeds = self._thinker.get_input_embeddings()(ids)
                for i, sess in enumerate(fed):
                    self._push(sess, embeds[i : i + 1], _OTHER)
            last = self._thinker_forward(active)
            logits = self._thinker.lm_head(last).float()
            logits[:, self._thinker_suppress] = -math.inf
            opts = self.options
            for b, sess in enumerate(active):
                if len(sess.token_ids) < opts.min_text_tokens:
                    logits[b, self._eos_ids] = -math.inf
            tokens = _sample(logits, opts.thinker_sampling, [s.thinker_gen for s in active])
            conditioning = self._talker.text_projection(
                self._thinker.get_input_embeddings()(tokens)
            )
            for b, (sess, tok) in enumerate(zip(active, tokens.tolist(), strict=True)):
                sess.last_token = tok
                is_eos = tok in self._ids["eos"]
                sess.token_ids.append(tok)
                sess.thinker_done = is_eos or len(sess.token_ids) >= opts.max_text_tokens
                results[id(sess)] = ThinkerToken(
                    self._detokenize(sess), conditioning[b], sess.thinker_done
                )
        return [results.get(id(s), ThinkerToken("", None, True)) for s in sessions]

    def _detokenize(self, sess: _Session) -> str:
        """The text the newest token completes; bytes of an unfinished character wait."""
        decode = self.tokenizer.decode
        ids = sess.token_ids
        before = decode(ids[sess.prefix_offset : sess.read_offset], skip_special_tokens=True)
        after = decode(ids[sess.prefix_offset :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            sess.prefix_offset, sess.read_offset = sess.read_offset, len(ids)
            return after[len(before) :]
        return ""

    # ---- Talker ------------------------------------------------------------------------------

    @torch.inference_mode()
    def talker_step(
        self, states: list[ModelState], tokens: list[ThinkerToken | None]
    ) -> list[TalkerFrame]:
        sessions = self._sessions(states)
        rows: list[tuple[_Session, torch.Tensor | None]] = []
        frames: dict[int, TalkerFrame] = {}
        for sess, tok in zip(sessions, tokens, strict=True):
            if tok is not None and sess.responding and not sess.talker_done:
                if tok.conditioning is not None:
                    sess.text_queue.append(tok.conditioning)
            if not sess.responding or sess.talker_done:
                frames[id(sess)] = TalkerFrame(None, True)
            elif sess.talker_slot is None:
                if not sess.text_queue:
                    # A reply whose text ended before it had any token has nothing to voice.
                    sess.talker_done = sess.thinker_done
                    frames[id(sess)] = TalkerFrame(None, sess.talker_done)
                else:
                    rows.append((sess, self._talker_prefill_input(sess)))
            else:
                rows.append((sess, None))
        stepping = [sess for sess, x in rows if x is None]
        if stepping:
            # One frame in: the sum of its codebooks' embeddings plus one text position.
            codes = torch.stack([sess.last_codes for sess in stepping])
            step_inputs = iter(
                self._codec_sum(codes) + torch.stack([self._next_text(s) for s in stepping])
            )
            rows = [(sess, next(step_inputs)[None] if x is None else x) for sess, x in rows]
        if rows:
            for sess, frame in zip((s for s, _ in rows), self._talker_forward(rows), strict=True):
                frames[id(sess)] = frame
        return [frames[id(s)] for s in sessions]

    def _talker_prefill_input(self, sess: _Session) -> torch.Tensor:
        first = sess.text_queue.popleft()
        # generate()'s assistant prefix: <|im_start|>assistant\n with no codec part, the fixed
        # middle, then the first text token together with codec_bos.
        assistant = torch.cat(
            [sess.talker_prefix, self._assistant_middle, (first + self._codec_bos)[None]]
        )
        sess.talker_slot = self._talker_kv.acquire(sess.sid)
        return torch.cat([*sess.talker_ctx, assistant])

    def _next_text(self, sess: _Session) -> torch.Tensor:
        if sess.text_queue:
            return sess.text_queue.popleft()
        if sess.thinker_done and not sess.eos_sent:
            sess.eos_sent = True
            return self._tts_eos
        return self._tts_pad

    def _codec_sum(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, Q) codes -> the Talker input embedding of that frame, the sum of all codebooks."""
        total = self._talker.get_input_embeddings()(codes[:, 0])
        for k, emb in enumerate(self._predictor.get_input_embeddings()):
            total = total + emb(codes[:, k + 1])
        return total

    def _talker_forward(self, rows: list[tuple[_Session, torch.Tensor]]) -> list[TalkerFrame]:
        opts = self.options
        sessions = [s for s, _ in rows]
        new = [x.shape[0] for _, x in rows]
        q, batch = max(new), len(rows)
        embeds = torch.nn.utils.rnn.pad_sequence([x for _, x in rows], batch_first=True)
        steps = torch.arange(q)
        positions = torch.stack(
            [
                sess.talker_pos + steps.clamp(max=n - 1)
                for sess, n in zip(sessions, new, strict=True)
            ]
        )
        kv = self._talker_kv.bind([s.talker_slot for s in sessions], [s.sid for s in sessions], new)
        out = self._talker.model(
            inputs_embeds=embeds,
            attention_mask=kv.mask,
            position_ids=positions.to(self.device)[None].expand(3, -1, -1),
            cache=kv,
            use_cache=True,
        )
        kv.commit()
        ends = torch.tensor(new, device=self.device) - 1
        last = out.last_hidden_state[torch.arange(batch, device=self.device), ends]
        logits = self._talker.codec_head(last).float()
        logits[:, self._codec_suppress] = -math.inf
        for b, sess in enumerate(sessions):
            sess.talker_pos += new[b]
            if sess.frames < opts.min_frames:
                logits[b, self._codec_eos] = -math.inf
        first = _sample(logits, opts.talker_sampling, [s.talker_gen for s in sessions])
        first_list = first.tolist()
        go = [b for b, code in enumerate(first_list) if code != self._codec_eos]
        codes = (
            self._residual_codes(last[go], first[go], [sessions[b].talker_gen for b in go])
            if go
            else None
        )
        result = []
        for b, sess in enumerate(sessions):
            if first_list[b] == self._codec_eos:
                sess.talker_done = True
                result.append(TalkerFrame(None, True))
                continue
            frame = codes[go.index(b)]
            sess.last_codes = frame
            sess.frames += 1
            sess.talker_done = sess.frames >= opts.max_frames
            result.append(TalkerFrame(frame, sess.talker_done))
        for sess in sessions:
            if sess.talker_done:
                # The reply's last frames still go through the codec; its Talker KV is done.
                self._talker_kv.release(sess.talker_slot, sess.sid)
                sess.talker_slot = None
        return result

    def _residual_codes(self, hidden: torch.Tensor, first: torch.Tensor, gens) -> torch.Tensor:
        """Codebooks 1..Q-1 from the code predictor, for all rows at once -> (B, Q)."""
        predictor = self._predictor
        cache = DynamicCache(config=predictor.config)
        x = torch.stack([hidden, self._talker.get_input_embeddings()(first)], dim=1)
        codes = [first]
        for k in range(self._num_codes - 1):
            if k:
                x = predictor.get_input_embeddings()[k - 1](codes[-1])[:, None]
            h = predictor.model(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state
            logits = predictor.lm_head[k](h[:, -1]).float()
            codes.append(_sample(logits, self.options.residual_sampling, gens))
        return torch.stack(codes, dim=1)

    # ---- codec -------------------------------------------------------------------------------

    @torch.inference_mode()
    def codec_decode(self, states: list[ModelState], codes: list[Any]) -> list[np.ndarray]:
        sessions = self._sessions(states)
        if len(codes) != len(sessions):
            raise ValueError(f"{len(codes)} code arrays for {len(sessions)} sessions")
        prepared = []
        for c in codes:
            c = torch.as_tensor(c, device=self.device, dtype=torch.long)
            prepared.append(c[:, None] if c.dim() == 1 else c)
        out: list[np.ndarray | None] = [None] * len(sessions)
        # One forward per distinct length; the engine sends one frame per session, so one group.
        by_len: dict[int, list[int]] = {}
        for i, c in enumerate(prepared):
            by_len.setdefault(c.shape[1], []).append(i)
        for idx in by_len.values():
            for i in idx:
                if sessions[i].codec_row is None:
                    sessions[i].codec_row = self._codec_pool.acquire(sessions[i].sid)
            pcm = self._codec_pool.decode(
                torch.stack([prepared[i] for i in idx]),
                [sessions[i].codec_row for i in idx],
                [sessions[i].sid for i in idx],
            )
            pcm = pcm.float().cpu().numpy()
            for j, i in enumerate(idx):
                out[i] = pcm[j]
        return out


def _smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: multiples of `factor`, aspect kept, pixel count within bounds."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _sample(logits: torch.Tensor, sampling: Sampling, gens: list[torch.Generator]) -> torch.Tensor:
    """(B, V) float logits -> (B,) ids; each row draws from its own session's generator."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p, always at least the best token.
        drop = cum - sorted_logits.softmax(-1) >= sampling.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, -math.inf))
    probs = logits.softmax(-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(gens)])
