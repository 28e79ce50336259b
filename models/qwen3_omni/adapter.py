"""Qwen3-Omni behind `DuplexModel`, every stage batched across sessions in one forward.

Thinker and Talker KV live in paged pools (`models.paged_kv`), one each, allocated once from the
KV memory budget (`kv_memory`): blocks of fixed size, a block table per session. A call writes
each row's new keys into that row's blocks and attends over them in place (on CUDA) or through a
gather (on the CPU) with explicit (M-RoPE) positions, so sessions whose contexts differ in length
share one forward with no copying of their past. Each slot records its owner and every call
checks it, so a reused slot can never feed one session's context to another. What each session
and reply may take of the pools is `memory`'s.

Two caches sit beside the pools and never hold a live session's state: the prefix cache (the
Thinker KV blocks of system turns, shared by reference, `models.prefix_cache`) and the feature
cache (vision encoder output, `models.feature_cache`). Adapters may share them; their keys
carry the weights' fingerprint (and the prefix cache's the pool), so one model's entries never
serve another.

The parts live in modules of their own (listed in `models.qwen3_omni`); this one builds them
and checks every state it is handed before any part touches it.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import Any

import numpy as np
import torch

from models.base import (
    DuplexModel,
    KVStats,
    ModelState,
    OfflineCodec,
    TalkerFrame,
    ThinkerToken,
)
from models.caches import FEATURE, PREFIX, CacheBudgets, CacheStats
from models.cuda_graphs import BucketGraphs, graph_settings
from models.feature_cache import FeatureCache
from models.fingerprint import fingerprint
from models.kv import SlotOwnershipError
from models.paged_attention import flex_works, use_paged_attention
from models.paged_kv import PagedKV, session_bytes, split_budget
from models.prefix_cache import PrefixCache
from models.qwen3_omni.codec import Code2WavPool, StreamingCode2Wav, offline_decode
from models.qwen3_omni.compat import thinker_parts
from models.qwen3_omni.encoders import (
    AudioEncoder,
    AudioFeatures,
    VisionEncoder,
    VisionFeatures,
)
from models.qwen3_omni.memory import KVMemory, talker_positions
from models.qwen3_omni.options import Qwen3OmniOptions, Sampling, Stream
from models.qwen3_omni.session import Pools, Session
from models.qwen3_omni.talker import Talker
from models.qwen3_omni.thinker import ContextTooLong, Thinker, render_system
from models.qwen3_omni.tiny import load, load_options, load_preprocessor, load_tokenizer
from models.reply import ReplySpec
from models.syncs import fetch

__all__ = [
    "OUTPUT_RATE",
    "STATE_KEY",
    "AudioFeatures",
    "ContextTooLong",
    "Qwen3OmniAdapter",
    "Qwen3OmniOptions",
    "Sampling",
    "SlotOwnershipError",
    "VisionFeatures",
]

log = logging.getLogger("duplex.models")

STATE_KEY = "qwen3_omni"
OUTPUT_RATE = 24000
CUDA_KV_FRACTION = 0.8
"""Of the device memory free once the weights are loaded, what the KV pools take by default;
the rest is for activations, graphs and the allocator's slack."""
CPU_KV_SESSIONS = 64
"""On the CPU the pools hold by default this many sessions at full context and reply (at most
a quarter of the memory available); their pages are only taken as blocks are used."""


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
    restores_context = True
    rewinds_context = True
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
        prefix_cache: PrefixCache | None = None,
        feature_cache: FeatureCache | None = None,
        cuda_graphs: bool = False,
        kv_memory: float = 0.0,
        kv_attention: str | None = None,
        static_steps: bool = False,
    ) -> None:
        """Without caches of its own the adapter makes them with the default budgets.
        `cuda_graphs`: on a CUDA device, the Thinker's and Talker's decode steps and the code
        predictor's frames replay CUDA graphs captured at `warm_up` (`models.cuda_graphs`).
        `static_steps`: they run from the fixed buffers such graphs hold, without capturing
        (what the CPU tests check against the eager path).
        `kv_memory`: the KV pools' budget, bytes (> 1) or a fraction of the memory free after
        the weights (<= 1), 0 for the default (`kv_budget`). `kv_attention`: "flex" or
        "gather" (`models.paged_attention`); None for the device's own."""
        budgets = CacheBudgets()
        self.prefix_cache = (
            PrefixCache(budgets.prefix_bytes) if prefix_cache is None else prefix_cache)
        self.feature_cache = (
            FeatureCache(budgets.feature_bytes) if feature_cache is None else feature_cache)
        self.device, self.dtype = str(device), str(dtype).removeprefix("torch.")
        torch_dtype = getattr(torch, self.dtype)
        self.model = _placed(model, self.device, torch_dtype)
        self.tokenizer = tokenizer
        self.options = options = options or Qwen3OmniOptions()
        self.config = model.config
        for part in (thinker_parts(model).text, model.talker.model):
            use_paged_attention(part.config)
        thinker_cfg = self.config.thinker_config
        parts = thinker_parts(model)
        self._audio = AudioEncoder(
            parts.audio,
            thinker_cfg.audio_config,
            preprocessor,
            self.input_rate,
            options.audio_chunk_samples,
            self.device,
            torch_dtype,
        )
        self.input_chunk_samples = self._audio.chunk_samples
        self._vision = VisionEncoder(
            parts.vision,
            thinker_cfg.vision_config,
            preprocessor,
            options.video_max_pixels,
            self.device,
            torch_dtype,
            self.feature_cache,
            fingerprint(parts.vision, thinker_cfg.vision_config, torch_dtype),
        )
        codec = StreamingCode2Wav(model.code2wav)
        self.frame_samples = codec.frame_samples
        thinker_kv, talker_kv = _kv_pools(self.config, options, self.device, torch_dtype,
                                          kv_memory, kv_attention)
        thinker_kv.spare = self.prefix_cache
        head = render_system(options.system_prompt or "", ())
        head_tokens = len(tokenizer.encode(head, add_special_tokens=False)) + 5 if head else 0
        self._memory = KVMemory(thinker_kv, talker_kv, options, head_tokens)
        self._pools = Pools(
            thinker=thinker_kv,
            talker=talker_kv,
            codec=Code2WavPool(codec),
            prefix=self.prefix_cache,
            memory=self._memory,
        )
        graphs = graph_settings(cuda_graphs, static_steps, self.device)
        self._talker = Talker(
            model, self._pools.talker, options, self.device, torch_dtype, graphs
        )
        self._thinker = Thinker(
            model, tokenizer, self._pools.thinker, self._talker, options, self.device, torch_dtype,
            self.prefix_cache, fingerprint(parts.text, thinker_cfg.text_config, torch_dtype),
            self._memory, graphs,
        )
        self.voices = self._talker.voices
        self.default_voice = options.speaker.lower()
        self.experts = experts_implementations(model)

    @classmethod
    def from_pretrained(
        cls,
        path,
        device: str = "cpu",
        dtype: str = "float32",
        options: Qwen3OmniOptions | None = None,
        budgets: CacheBudgets | None = None,
        cuda_graphs: bool = False,
        kv_memory: float = 0.0,
    ) -> Qwen3OmniAdapter:
        """Without `options`, the checkpoint's duplex_options.json (if any) over the defaults.
        `cuda_graphs`: the decode steps and the code predictor as CUDA graphs, on a CUDA device.
        `kv_memory`: the KV pools' budget (see `__init__`)."""
        model = load(path, device, dtype)
        options = options or Qwen3OmniOptions(**load_options(path))
        budgets = budgets or CacheBudgets()
        return cls(
            model,
            load_tokenizer(path),
            load_preprocessor(path, model.config),
            device,
            dtype,
            options,
            PrefixCache(budgets.prefix_bytes),
            FeatureCache(budgets.feature_bytes),
            cuda_graphs,
            kv_memory,
        )

    def warm_up(self, max_batch: int) -> dict[str, Any]:
        """Capture the graphs of the Thinker's and Talker's decode steps and of the code
        predictor's frames for every bucket up to `max_batch`, largest first (with
        `cuda_graphs` on a CUDA device), and check the MoE experts' implementation: on a GPU,
        transformers' eager fallback loops over the experts with a host sync each (~50k
        launches per Thinker step at batch 64, against a few with grouped_mm), and cannot be
        captured."""
        report: dict[str, Any] = {"experts": self.experts, "warnings": []}
        slow = {part: impl for part, impl in self.experts.items() if impl != "grouped_mm"}
        if slow and self.device.startswith("cuda"):
            warning = (f"MoE experts not on grouped_mm ({slow}): every Thinker and Talker step "
                       "loops over experts with a host sync each; expect it to be many times "
                       "slower (transformers fell back, or experts_implementation was set)")
            log.warning(warning)
            report["warnings"].append(warning)
        runners = self.graph_runners()
        cuda = self.device.startswith("cuda")
        reserved = torch.cuda.memory_reserved(self.device) if cuda and runners else 0
        for name, runner in runners.items():
            if runner.capture and name in slow:
                # The eager experts' host syncs cannot be captured: eager, said once here.
                report["warnings"].append(f"{name} decode steps not captured: its experts are "
                                          "not on grouped_mm")
                report[f"{name}_graphs"] = []
                continue
            report[f"{name}_graphs"] = list(runner.warm_up(max_batch))
            if runner.capture_ms:
                report.setdefault("graph_capture_ms", {})[name] = dict(runner.capture_ms)
            if runner.failed:
                report["warnings"].append(f"{name} CUDA graph capture failed: eager")
        if cuda and runners:
            torch.cuda.synchronize(self.device)
            grown = torch.cuda.memory_reserved(self.device) - reserved
            report["graph_memory_mib"] = round(grown / 2**20, 1)
        return report

    def graph_runners(self) -> dict[str, BucketGraphs]:
        """The fixed-buffer runners by stage (none without `cuda_graphs` on CUDA or
        `static_steps`), in the order they capture: the largest graph first, so the others'
        intermediates fit in the pool it left. By arithmetic (README) that is the code
        predictor's, whose frame hashes noise for every candidate code."""
        runners = {"code_predictor": self._talker.graphs, "thinker": self._thinker.graphs,
                   "talker": self._talker.step_graphs}
        return {name: runner for name, runner in runners.items() if runner is not None}

    def graph_stats(self) -> dict[str, dict[str, int]]:
        return {"thinker": dict(self._thinker.steps), "talker": dict(self._talker.steps),
                "code_predictor": dict(self._talker.frames)}

    # ---- per-session state -------------------------------------------------------------------

    def new_state(self, session_id: str) -> ModelState:
        seed = (zlib.crc32(session_id.encode()) ^ self.options.seed) & 0x7FFFFFFF
        sess = Session(session_id, self._pools, Stream(seed), Stream(seed ^ 0x5A5A5A5A))
        self._thinker.start(sess)
        return ModelState(session_id, {STATE_KEY: sess})

    def _session(self, state: ModelState) -> Session:
        sess = state.slots.get(STATE_KEY)
        if sess is None:
            raise ValueError(f"session {state.session_id!r} holds no Qwen3-Omni state (freed?)")
        if sess.sid != state.session_id:
            raise SlotOwnershipError(
                f"state of {state.session_id!r} carries {sess.sid!r}'s session"
            )
        return sess

    def _sessions(self, states: list[ModelState]) -> list[Session]:
        """The batch's sessions, every held slot checked against its owner before any change."""
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a batch must not hold the same state twice")
        sessions = [self._session(s) for s in states]
        for sess in sessions:
            sess.check()
        return sessions

    def cache_stats(self) -> dict[str, CacheStats]:
        return {PREFIX: self.prefix_cache.stats(), FEATURE: self.feature_cache.stats()}

    def kv_stats(self) -> dict[str, KVStats]:
        return self._memory.stats()

    def reset_response(self, state: ModelState) -> None:
        self._session(state).end_reply()

    def free(self, state: ModelState) -> None:
        if STATE_KEY in state.slots:
            # A state carrying another session's must not give back that session's rows.
            self._session(state)
        super().free(state)

    # ---- stages ------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_audio(self, states: list[ModelState], chunks: list[np.ndarray]) -> list[Any]:
        self._sessions(states)
        return self._audio.encode(chunks) if chunks else []

    @torch.inference_mode()
    def encode_video(self, states: list[ModelState], frames: list[np.ndarray]) -> list[Any]:
        self._sessions(states)
        return self._vision.encode(frames) if frames else []

    @torch.inference_mode()
    def thinker_prefill(self, states: list[ModelState], features: list[Any]) -> None:
        """Each feature is AudioFeatures, VisionFeatures, a TextTurn or ReplyTurn, a Mark or
        Rewind at an item boundary, or None (nothing to add).

        New input while a reply is being generated ends that reply's text.
        """
        self._thinker.prefill(self._sessions(states), features)

    @torch.inference_mode()
    def instruct(self, state: ModelState, instructions: str,
                 tools: tuple[dict[str, Any], ...]) -> None:
        self._thinker.instruct(self._session(state), instructions, tools)

    @torch.inference_mode()
    def begin_response(self, state: ModelState, spec: ReplySpec | None = None) -> None:
        spec = spec or ReplySpec()
        sess = self._session(state)
        sess.end_reply()
        sess.voice = (spec.voice or self.default_voice).lower()
        if sess.voice not in self.voices:
            raise ValueError(f"unknown voice {spec.voice!r}; have {', '.join(self.voices)}")
        sess.temperature = spec.temperature
        sess.truncation = spec.truncation
        # The chat template has no tool choice; a model never told of the tools calls none,
        # and "required" or a named function is enforced by constraining the reply's tokens.
        tools = () if spec.tool_choice == "none" else spec.tools
        self._thinker.begin(sess, spec.instructions, tools)
        sess.forcing = self._thinker.forcing(spec.tool_choice, spec.tools)
        sess.call_tools = tools
        sess.token_limit = self.options.max_text_tokens + (
            sess.forcing.overhead if sess.forcing else 0)
        sess.budget = min(sess.token_limit, spec.max_output_tokens or sess.token_limit)
        self._thinker.admit_reply(sess, spec.audio)

    @torch.inference_mode()
    def thinker_decode(self, states: list[ModelState]) -> list[ThinkerToken]:
        return self._thinker.decode(self._sessions(states))

    @torch.inference_mode()
    def talker_step(
        self, states: list[ModelState], tokens: list[ThinkerToken | None]
    ) -> list[TalkerFrame]:
        return self._talker.step(self._sessions(states), tokens)

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
        pool = self._pools.codec
        # One forward per distinct length; the engine sends one frame per session, so one group.
        by_len: dict[int, list[int]] = {}
        for i, c in enumerate(prepared):
            by_len.setdefault(c.shape[1], []).append(i)
        for idx in by_len.values():
            for i in idx:
                if sessions[i].codec_row is None:
                    sessions[i].codec_row = pool.acquire(sessions[i].sid)
            pcm = pool.decode(
                torch.stack([prepared[i] for i in idx]),
                [sessions[i].codec_row for i in idx],
                [sessions[i].sid for i in idx],
            )
            pcm = fetch(pcm.float())
            for j, i in enumerate(idx):
                out[i] = pcm[j]
        return out

    def offline_codec(self) -> OfflineCodec:
        config = self.model.code2wav.config
        return OfflineCodec(
            config.num_quantizers,
            config.codebook_size,
            self._pools.codec.decoder.delay_samples,
            self._decode_offline,
        )

    def _decode_offline(self, codes: np.ndarray) -> np.ndarray:
        codes = torch.as_tensor(codes, device=self.device, dtype=torch.long)
        return offline_decode(self.model.code2wav, codes).float().cpu().numpy()


def _placed(model, device: str, dtype: torch.dtype):
    """The model on `device`, in eval mode, its parameters in `dtype`."""
    model = model.to(device).eval()
    if model.dtype != dtype:
        # Parameters only: the rotary inv_freq buffers must stay float32, in bf16 a phase
        # at position 10^4 would be off by whole turns.
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(dtype)
    return model


def experts_implementations(model) -> dict[str, str]:
    """The experts implementation each MoE part (thinker, talker) runs, as its experts
    modules read it at every forward."""
    found: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "config"):
            impl = getattr(module.config, "_experts_implementation", None)
            found.setdefault(name.split(".")[0], set()).add(str(impl))
    return {part: "/".join(sorted(impls)) for part, impls in sorted(found.items())}


def _shape(text_config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a text model's KV."""
    head_dim = (
        getattr(text_config, "head_dim", None)
        or text_config.hidden_size // text_config.num_attention_heads
    )
    return text_config.num_hidden_layers, text_config.num_key_value_heads, head_dim


def kv_budget(kv_memory: float, device: str, session_bytes: int) -> int:
    """The KV pools' bytes: `kv_memory` bytes (> 1), or that fraction of the memory free now
    (<= 1: on CUDA the device's, after the weights; on the CPU what the host has available);
    0: CUDA_KV_FRACTION on CUDA, CPU_KV_SESSIONS sessions of `session_bytes` on the CPU."""
    if kv_memory > 1:
        return int(kv_memory)
    if device.startswith("cuda"):
        free = torch.cuda.mem_get_info(torch.device(device))[0]
        return int(free * (kv_memory or CUDA_KV_FRACTION))
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if kv_memory:
        return int(available * kv_memory)
    return min(CPU_KV_SESSIONS * session_bytes, available // 4)


def _kv_pools(config, options: Qwen3OmniOptions, device: str, dtype: torch.dtype,
              kv_memory: float, attention: str | None) -> tuple[PagedKV, PagedKV]:
    """The Thinker's and Talker's pools from one budget, split so each holds as many sessions
    at full context (the Thinker's `max_context`, the Talker's longest reply)."""
    shapes = (_shape(config.thinker_config.text_config), _shape(config.talker_config.text_config))
    itemsize = torch.empty((), dtype=dtype).element_size()
    position_bytes = tuple(2 * layers * heads * dim * itemsize for layers, heads, dim in shapes)
    positions = (options.max_context, talker_positions(options))
    budget = kv_budget(kv_memory, device, session_bytes(position_bytes, positions))
    blocks = split_budget(budget, position_bytes, positions)
    cuda = device.startswith("cuda")
    pools = tuple(PagedKV(*shape, device, dtype, n, limit,
                          attention=attention or ("flex" if cuda else "gather"))
                  for shape, n, limit in zip(shapes, blocks, positions, strict=True))
    for pool in pools:
        if pool.attention == "flex" and cuda and not flex_works(pool):
            pool.attention = "gather"
    log.info("KV pools: Thinker %d blocks, Talker %d blocks of %d positions (%.2f GiB), %s",
             *blocks, pools[0].block_size, sum(p.nbytes for p in pools) / 2**30,
             pools[0].attention)
    return pools
