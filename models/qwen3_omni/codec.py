"""Exact, frame-by-frame streaming for Qwen3-Omni's codec decoder (`Qwen3OmniMoeCode2Wav`).

The offline decoder is causal, but transformers offers no state-carrying API for it:
`chunked_decode` re-decodes context and still loses samples at every chunk edge. Here each
causal convolution keeps its left context, each transposed convolution keeps its overlap-add tail
and the sliding-window transformer keeps its last `sliding_window - 1` keys and values, so a
new frame costs its share of an offline decode's arithmetic plus a fixed per-call cost (a few
hundred small ops, ~2 ms on one CPU thread) that batching several streams into one call shares.

Alignment: offline decoding of T frames yields `T * frame_samples - delay_samples` samples, because
every transposed convolution with kernel 2*stride trims `stride` samples on both sides, and a
trimmed sample needs the next input. Streaming returns exactly `frame_samples` per frame: the
offline signal preceded by `delay_samples` zeros (555 samples, 23 ms, in the real config), so
`stream[:, delay_samples:] == offline`.

State is slot-indexed: one `Code2WavState` holds B independent streams along dim 0, and a
`Code2WavPool` gives each session a row of one such state and decodes any subset of its rows
(`decode(..., slots=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
    Qwen3OmniMoeSnakeBeta,
    apply_rotary_pos_emb,
)

from models.syncs import upload


def tiny_code2wav_config() -> Qwen3OmniMoeCode2WavConfig:
    """A ~0.14 M-parameter Code2Wav with the real rates: 1920 samples per frame at 24 kHz.

    Only widths and depths shrink; the upsampling chain (2*2 then 8*5*4*3) is the real one, and
    fewer KV heads than query heads exercise the grouped-query path.
    """
    return Qwen3OmniMoeCode2WavConfig(
        codebook_size=64,
        num_quantizers=4,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        num_hidden_layers=2,
        sliding_window=8,
        decoder_dim=64,
        max_position_embeddings=4096,
    )


def offline_decode(module: Qwen3OmniMoeCode2Wav, codes: torch.Tensor) -> torch.Tensor:
    """The module's own forward: codes (B, Q, T) -> (B, T * frame_samples - delay_samples)."""
    with torch.inference_mode():
        return module(codes)[:, 0]


@dataclass
class Code2WavState:
    """Carried context of B independent streams; every tensor has the slot on dim 0."""

    frames: np.ndarray
    """(B,) int64 on the host: frames decoded per slot since its last reset. Kept there
    because it decides, without a device read, whether a call still touches a stream's start."""
    buffers: list[torch.Tensor]
    """Inference tensors, so every method that writes them runs under inference mode."""

    @property
    def batch_size(self) -> int:
        return self.frames.shape[0]

    @cached_property
    def nbytes(self) -> int:
        """Fixed for a state (its buffers are written in place or replaced by the same shape),
        and read for every session at every engine report."""
        return self.frames.nbytes + sum(t.numel() * t.element_size() for t in self.buffers)

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    @torch.inference_mode()
    def reset(self, slots: list[int] | None = None) -> None:
        """Restart the given slots (all when None) at frame 0."""
        if slots is None:
            self.frames[:] = 0
            for buf in self.buffers:
                buf.zero_()
            return
        self.frames[slots] = 0
        index = upload(slots, self.device)
        for buf in self.buffers:
            buf.index_fill_(0, index, 0)

    @torch.inference_mode()
    def take(self, slots: list[int], index: torch.Tensor) -> Code2WavState:
        """A copy of the given slots, in that order; `index` is `slots` on the device."""
        return Code2WavState(
            self.frames[slots], [buf.index_select(0, index) for buf in self.buffers]
        )

    @torch.inference_mode()
    def put(self, slots: list[int], index: torch.Tensor, part: Code2WavState) -> None:
        """Write `part` (one row per entry of `slots`) back into the given slots."""
        self.frames[slots] = part.frames
        for buf, new in zip(self.buffers, part.buffers, strict=True):
            buf.index_copy_(0, index, new)

    @torch.inference_mode()
    def head(self, n: int) -> Code2WavState:
        """A copy of the first `n` slots."""
        return Code2WavState(self.frames[:n].copy(), [buf[:n].clone() for buf in self.buffers])

    @staticmethod
    @torch.inference_mode()
    def cat(states: Sequence[Code2WavState]) -> Code2WavState:
        """Join per-session states into one batch, in order."""
        return Code2WavState(
            np.concatenate([s.frames for s in states]),
            [torch.cat(bufs) for bufs in zip(*(s.buffers for s in states), strict=True)],
        )


class Code2WavPool:
    """The streams of many sessions as rows of one state, so a batch moves its rows with one
    gather and one scatter per buffer instead of joining and splitting per-session states
    (at 32 sessions that took a third as long as the decode itself).

    A session takes a row at its reply's first frame and gives it back when its next reply
    begins, when a reply is cancelled, or when it closes (the adapter's `reset_response`). The
    pool gives back trailing free rows once fewer than a quarter are in use (not at half, where
    one reply starting and ending at a power of two would copy the whole state each time), and
    all of its memory when no row is held.
    """

    def __init__(self, decoder: StreamingCode2Wav) -> None:
        self.decoder = decoder
        self.state: Code2WavState | None = None
        self.owner: list[str | None] = []

    def row_bytes(self) -> int:
        return self.state.nbytes // len(self.owner) if self.owner else 0

    @torch.inference_mode()
    def acquire(self, owner: str) -> int:
        if None in self.owner:
            row = self.owner.index(None)
            self.state.reset([row])
        else:
            row = len(self.owner)
            grown = self.decoder.new_state(max(1, row))
            self.state = grown if self.state is None else Code2WavState.cat([self.state, grown])
            self.owner += [None] * grown.batch_size
        self.owner[row] = owner
        return row

    def check(self, row: int, owner: str) -> None:
        if self.owner[row] != owner:
            raise ValueError(f"codec row {row} belongs to {self.owner[row]!r}, not {owner!r}")

    def release(self, row: int, owner: str) -> None:
        self.check(row, owner)
        self.owner[row] = None
        used = [i for i, o in enumerate(self.owner) if o is not None]
        if not used:
            self.state, self.owner = None, []
        elif used[-1] < len(self.owner) // 4:
            # Past a burst of replies, give back the rows at the end nobody holds.
            self.state = self.state.head(used[-1] + 1)
            self.owner = self.owner[: used[-1] + 1]

    def decode(self, codes: torch.Tensor, rows: list[int], owners: list[str]) -> torch.Tensor:
        """Codes (B, Q, T_new), row b of them continuing pool row `rows[b]` (owned by
        `owners[b]`) -> PCM (B, T_new * frame_samples)."""
        for row, owner in zip(rows, owners, strict=True):
            self.check(row, owner)
        return self.decoder.decode(codes, self.state, slots=rows)


class _Call:
    """What one `decode` call shares across stages: the carried buffers and slot positions."""

    def __init__(self, state: Code2WavState, n_new: int, device: torch.device) -> None:
        self.buffers = state.buffers
        self.frames = upload(state.frames, device)
        self.first_frame = int(state.frames.min())
        self.n_new = n_new

    def zero_lead(self, x: torch.Tensor, rate: int, delay: int) -> torch.Tensor:
        """Zero the samples of x (B, C, n_new * rate) that lie in a stream's first `delay`.

        Those samples are not part of the offline signal (they come from a transposed conv's
        left trim); the offline path has zero padding there, and a conv reading them as left
        context must see the same zeros.
        """
        if self.first_frame * rate >= delay:
            return x
        lead = delay - self.frames * rate
        keep = torch.arange(x.shape[-1], device=x.device) >= lead[:, None]
        return torch.where(keep[:, None, :], x, 0.0)


class _Conv:
    """A stride-1 `Qwen3OmniMoeCausalConvNet` whose zero left padding becomes carried context."""

    def __init__(self, module: Qwen3OmniMoeCausalConvNet, index: int | None, rate: int, delay: int):
        if module.stride != 1:
            raise NotImplementedError("Code2Wav only has stride-1 causal convolutions")
        self.conv = module.conv
        self.context = module.padding
        self.index, self.rate, self.delay = index, rate, delay

    def __call__(self, x: torch.Tensor, call: _Call) -> torch.Tensor:
        if self.context == 0:
            conv = self.conv
            if conv.groups != 1:
                return conv(x)
            # A pointwise convolution is a matrix product per slot; through oneDNN's conv1d a
            # whole decode of 32 slots' frames took 25 ms on one CPU thread, this way 20 ms.
            weight = conv.weight[:, :, 0]
            if conv.bias is None:
                return torch.matmul(weight, x)
            return torch.baddbmm(conv.bias[:, None], weight.expand(x.shape[0], -1, -1), x)
        x = call.zero_lead(x, self.rate, self.delay)
        full = torch.cat([call.buffers[self.index], x], dim=-1)
        call.buffers[self.index] = full[..., x.shape[-1] :].clone()
        conv = self.conv
        depthwise = conv.groups == conv.in_channels == conv.out_channels
        if full.device.type != "cpu" or not (conv.groups == 1 or depthwise):
            return conv(full)
        # On the CPU, PyTorch sends a dilated, grouped or batched 1-d convolution to
        # slow_conv_dilated2d or oneDNN, ~50 us a call even on the few samples of one frame; an
        # explicit im2col is 2-3x cheaper there and within ~40% elsewhere.
        cols = full.unfold(-1, self.context + 1, 1)[..., :: conv.dilation[0]]
        if depthwise:
            out = (cols * conv.weight[:, None, 0, :]).sum(-1)
            return out if conv.bias is None else out + conv.bias[:, None]
        batch, channels, length, taps = cols.shape
        cols = cols.transpose(2, 3).reshape(batch, channels * taps, length)
        weight = conv.weight.view(1, conv.out_channels, -1).expand(batch, -1, -1)
        if conv.bias is None:
            return torch.bmm(weight, cols)
        return torch.baddbmm(conv.bias[:, None], weight, cols)


class _TransConv:
    """A `Qwen3OmniMoeCausalTransConvNet` run as overlap-add with its tail carried.

    Without the trims, its raw output stream is the offline output preceded by `kernel - stride`
    samples, so this adds `kernel - stride` to the stream's delay instead of trimming per call
    (trimming per call would give slots at different positions different lengths).
    """

    def __init__(self, module: Qwen3OmniMoeCausalTransConvNet, index: int | None):
        conv = module.conv
        self.conv = conv
        self.kernel = conv.kernel_size[0]
        self.stride = conv.stride[0]
        self.overlap = self.kernel - self.stride
        layout = (conv.padding[0], conv.output_padding[0], conv.dilation[0], conv.groups)
        if module.left_pad != self.overlap or layout != (0, 0, 1, 1):
            raise NotImplementedError("unexpected transposed convolution layout")
        self.index = index

    def __call__(self, x: torch.Tensor, call: _Call) -> torch.Tensor:
        # As one matmul on the weight's own (C_in, C_out * kernel) layout plus col2im: on the CPU,
        # conv_transpose1d on a frame's few samples is up to 10x slower (110 ms against 10 ms for
        # the real config's first decoder block).
        conv = self.conv
        batch, in_channels, length = x.shape
        cols = torch.matmul(x.transpose(1, 2), conv.weight.view(in_channels, -1))
        raw_length = (length - 1) * self.stride + self.kernel
        raw = F.fold(
            cols.transpose(1, 2), (1, raw_length), (1, self.kernel), stride=(1, self.stride)
        ).view(batch, conv.out_channels, raw_length)
        n_out = length * self.stride
        if self.overlap:
            raw[..., : self.overlap] += call.buffers[self.index]
            call.buffers[self.index] = raw[..., n_out:].clone()
        out = raw[..., :n_out]
        if conv.bias is not None:
            # Bias once per emitted sample, not on the carried partial sums.
            out = out + conv.bias[:, None]
        return out


class _Snake:
    """`Qwen3OmniMoeSnakeBeta`, x + sin(x * e^alpha)^2 / (e^beta + eps), exponentials hoisted.

    The module's forward spends ~13 small ops per call re-deriving them, and a frame runs ~30 of
    these activations on a few samples each. The derived tensors are rebuilt whenever a
    parameter's storage or version changes, so weights loaded or moved later still count.
    """

    def __init__(self, module: Qwen3OmniMoeSnakeBeta) -> None:
        self.module = module
        self._key: tuple[int, ...] = ()

    def __call__(self, x: torch.Tensor, call: _Call) -> torch.Tensor:
        snake = self.module
        alpha, beta = snake.alpha, snake.beta
        key = (alpha.data_ptr(), alpha._version, beta.data_ptr(), beta._version)
        if key != self._key:
            self._scale = torch.exp(alpha)[:, None]
            self._gain = (1.0 / (torch.exp(beta) + snake.no_div_by_zero))[:, None]
            self._key = key
        return torch.addcmul(x, self._gain, torch.sin(x * self._scale).square())


class _Residual:
    """A `Qwen3OmniMoeCode2WavDecoderResidualUnit` with streaming convolutions."""

    def __init__(self, unit: Qwen3OmniMoeCode2WavDecoderResidualUnit, conv1: _Conv, conv2: _Conv):
        self.act1, self.act2 = _Snake(unit.act1), _Snake(unit.act2)
        self.conv1, self.conv2 = conv1, conv2

    def __call__(self, x: torch.Tensor, call: _Call) -> torch.Tensor:
        y = self.conv1(self.act1(x, call), call)
        return x + self.conv2(self.act2(y, call), call)


class _ConvNeXt:
    """A `Qwen3OmniMoeConvNeXtBlock` with a streaming depthwise convolution."""

    def __init__(self, block: Qwen3OmniMoeConvNeXtBlock, dwconv: _Conv) -> None:
        self.block, self.dwconv = block, dwconv

    def __call__(self, x: torch.Tensor, call: _Call) -> torch.Tensor:
        block = self.block
        y = self.dwconv(x, call).transpose(1, 2)
        y = block.pwconv2(block.act(block.pwconv1(block.norm(y))))
        return x + (block.gamma * y).transpose(1, 2)


class StreamingCode2Wav:
    """Frame-by-frame decoding through a `Qwen3OmniMoeCode2Wav`'s own submodules.

    `decode` appends `codes` (B, Q, T_new) to B streams and returns (B, T_new * frame_samples).
    The path has no dropout, so it matches the module in eval mode whatever its mode.
    """

    def __init__(self, module: Qwen3OmniMoeCode2Wav) -> None:
        self.module = module
        config = module.config
        self.window = config.sliding_window
        self.num_quantizers = config.num_quantizers
        head_dim = module.pre_transformer.layers[0].self_attn.head_dim
        kv_shape = (config.num_key_value_heads, self.window - 1, head_dim)
        # Buffers 2i and 2i+1 are layer i's keys and values; the convolutions' follow.
        self._buffer_shapes = [kv_shape] * (2 * config.num_hidden_layers)

        # Samples per frame, and leading samples not yet part of the offline signal, at each step.
        rate, delay = 1, 0
        self._steps: list[_Conv | _TransConv | _Snake | _Residual | _ConvNeXt] = []
        parts = [part for blocks in module.upsample for part in blocks]
        for block in module.decoder:
            is_block = isinstance(block, Qwen3OmniMoeCode2WavDecoderBlock)
            parts += block.block if is_block else [block]
        for part in parts:
            if isinstance(part, Qwen3OmniMoeCausalConvNet):
                self._steps.append(self._conv(part, rate, delay))
            elif isinstance(part, Qwen3OmniMoeSnakeBeta):
                self._steps.append(_Snake(part))
            elif isinstance(part, Qwen3OmniMoeCausalTransConvNet):
                step = self._trans_conv(part)
                rate, delay = rate * step.stride, delay * step.stride + step.overlap
                self._steps.append(step)
            elif isinstance(part, Qwen3OmniMoeConvNeXtBlock):
                self._steps.append(_ConvNeXt(part, self._conv(part.dwconv, rate, delay)))
            elif isinstance(part, Qwen3OmniMoeCode2WavDecoderResidualUnit):
                conv1 = self._conv(part.conv1, rate, delay)
                self._steps.append(_Residual(part, conv1, self._conv(part.conv2, rate, delay)))
            else:
                raise NotImplementedError(f"no streaming form for {type(part).__name__}")
        self.frame_samples = rate
        self.delay_samples = delay

    def _conv(self, module: Qwen3OmniMoeCausalConvNet, rate: int, delay: int) -> _Conv:
        index = None
        if module.padding:
            index = len(self._buffer_shapes)
            self._buffer_shapes.append((module.conv.in_channels, module.padding))
        return _Conv(module, index, rate, delay)

    def _trans_conv(self, module: Qwen3OmniMoeCausalTransConvNet) -> _TransConv:
        conv = module.conv
        overlap = conv.kernel_size[0] - conv.stride[0]
        index = None
        if overlap:
            index = len(self._buffer_shapes)
            self._buffer_shapes.append((conv.out_channels, overlap))
        return _TransConv(module, index)

    @torch.inference_mode()
    def new_state(self, batch_size: int) -> Code2WavState:
        param = self.module.code_embedding.weight
        return Code2WavState(
            np.zeros(batch_size, dtype=np.int64),
            [
                torch.zeros(batch_size, *shape, dtype=param.dtype, device=param.device)
                for shape in self._buffer_shapes
            ],
        )

    def decode(
        self, codes: torch.Tensor, state: Code2WavState, slots: list[int] | None = None
    ) -> torch.Tensor:
        """Codes (B, Q, T_new) -> PCM (B, T_new * frame_samples); advances the streams.

        Without `slots`, row b of `codes` continues slot b of `state` (B == state.batch_size).
        With `slots`, row b continues slot `slots[b]` and other slots are untouched; the slots
        cross to the device once for all carried buffers.
        """
        if slots is not None:
            index = upload(slots, state.device)
            part = state.take(slots, index)
            pcm = self.decode(codes, part)
            state.put(slots, index, part)
            return pcm
        batch, n_q, n_new = codes.shape
        if n_q != self.num_quantizers:
            raise ValueError(f"expected {self.num_quantizers} codebooks, got {n_q}")
        if batch != state.batch_size:
            raise ValueError(f"codes batch {batch} != state batch {state.batch_size}")
        module = self.module
        with torch.inference_mode():
            call = _Call(state, n_new, codes.device)
            hidden = module.code_embedding(codes + module.code_offset).mean(1)
            hidden = self._transformer(hidden, call).transpose(1, 2)
            for step in self._steps:
                hidden = step(hidden, call)
            wav = call.zero_lead(
                hidden.clamp(min=-1, max=1), self.frame_samples, self.delay_samples
            )
            state.frames += n_new
        return wav[:, 0]

    def _transformer(self, hidden: torch.Tensor, call: _Call) -> torch.Tensor:
        """The sliding-window transformer over new frames, attending to cached keys and values.

        Offline masking lets position p see keys in (p - sliding_window, p]; the cache holds the
        last sliding_window - 1 positions of each slot, and positions before a slot's start are
        masked out.
        """
        pre = self.module.pre_transformer
        n_cached = self.window - 1
        offsets = torch.arange(n_cached + call.n_new, device=hidden.device)
        key_pos = call.frames[:, None] - n_cached + offsets
        query_pos = key_pos[:, n_cached:]
        allowed = (
            (key_pos[:, None, :] >= 0)
            & (key_pos[:, None, :] <= query_pos[:, :, None])
            & (key_pos[:, None, :] > query_pos[:, :, None] - self.window)
        )[:, None]
        cos, sin = pre.rotary_emb(hidden, query_pos)
        for i, layer in enumerate(pre.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys = torch.cat([call.buffers[2 * i], k], dim=2)
            values = torch.cat([call.buffers[2 * i + 1], v], dim=2)
            call.buffers[2 * i] = keys[:, :, call.n_new :].clone()
            call.buffers[2 * i + 1] = values[:, :, call.n_new :].clone()
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=attn.scaling, enable_gqa=True
            )
            out = attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))
            hidden = hidden + layer.self_attn_layer_scale(out)
            mlp_out = layer.mlp(layer.post_attention_layernorm(hidden))
            hidden = hidden + layer.mlp_layer_scale(mlp_out)
        return pre.norm(hidden)
