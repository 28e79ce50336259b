"""Exact frame-by-frame streaming for transformers' `MimiModel`, batched across sessions.

Decoding: Mimi's own `decoder_cache` only carries the decoder transformer's keys and values; its
causal convolutions then pad every chunk with zeros as if it were the start of the stream, so
chunked decoding drifts far from offline decoding. `MimiStreamDecoder` carries the state of every
causal conv (the last `padding_total` inputs), of every transposed conv (the overlapping tail of
its output) and of the decoder transformer (a sliding-window KV cache), so streaming output equals
`mimi.decode(codes)` up to float rounding.

Encoding: `MimiStreamEncoder` carries the last `padding_total` inputs of every conv as the
decoder does (what transformers' `MimiConv1dPaddingCache` keeps; exact when chunks are whole
frames) and runs the encoder transformer through the same sliding-window KV as the decoder,
because `encode(..., use_streaming=True)` keeps one cache for the whole batch and cannot mix
sessions of different ages.

Each session owns a state object (`new_state()`); one `decode` / `encode` call stacks the states
of all sessions in the batch along the batch axis, runs one forward and writes the states back.
The transformers keep their keys and values in `models.kv.SlidingKV`, as Moshi's decoders do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.mimi.modeling_mimi import (
    MimiConv1d,
    MimiConvTranspose1d,
    MimiResnetBlock,
    apply_rotary_pos_emb,
)

from models.kv import KVBatch, SlidingKV, tensor_bytes


def _decoder_parts(mimi: nn.Module) -> tuple[nn.Module | None, nn.Module, nn.Module]:
    """(upsample, decoder transformer, SEANet decoder) across transformers' two Mimi layouts."""
    if hasattr(mimi.decoder, "decoder_seanet"):
        return mimi.decoder.upsample, mimi.decoder.decoder_transformer, mimi.decoder.decoder_seanet
    return mimi.upsample, mimi.decoder_transformer, mimi.decoder


def _encoder_parts(mimi: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(SEANet encoder, encoder transformer, downsample) across transformers' two Mimi layouts."""
    if hasattr(mimi.encoder, "encoder_seanet"):
        return (
            mimi.encoder.encoder_seanet,
            mimi.encoder.encoder_transformer,
            mimi.encoder.downsample,
        )
    return mimi.encoder, mimi.encoder_transformer, mimi.downsample


def _new_kv(transformer: nn.Module, dtype: torch.dtype, device) -> SlidingKV:
    config = transformer.config
    return SlidingKV(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        config.sliding_window,
        dtype=dtype,
        device=device,
    )


def _transformer_step(transformer: nn.Module, hidden: torch.Tensor, kvs: list[SlidingKV]):
    """A `MimiTransformerModel` over (B, n, C) new positions, continuing each row's KV."""
    batch = KVBatch(kvs, hidden.shape[1])
    cos, sin = transformer.rotary_emb(hidden, batch.position_ids)
    for index, layer in enumerate(transformer.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        shape = (*x.shape[:2], -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = batch.attend(index, q, k, v, attn.scaling).transpose(1, 2).reshape(*x.shape[:2], -1)
        hidden = hidden + layer.self_attn_layer_scale(attn.o_proj(out))
        hidden = hidden + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(hidden)))
    batch.commit()
    return hidden


@dataclass
class MimiDecodeState:
    """One session's decoder carry: one tensor per causal/transposed conv, and the transformer KV."""

    convs: list[torch.Tensor]
    kv: SlidingKV

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.convs) + self.kv.nbytes

    def release(self) -> None:
        self.convs = []
        self.kv.release()


class _Carry:
    """The conv states of one decode call: read in network order, written in the same order."""

    def __init__(self, incoming: list[torch.Tensor]):
        self.incoming = iter(incoming)
        self.outgoing: list[torch.Tensor] = []

    def left(self, module: MimiConv1d, x: torch.Tensor) -> torch.Tensor:
        return next(self.incoming)


class _EncodeCarry(_Carry):
    """The conv states of one encode call, row by row: a session's first call has none yet and
    pads as `MimiConv1d` does at the start of a stream (zeros, or its first input replicated)."""

    def __init__(self, rows: list[list[torch.Tensor | None]]):
        super().__init__(list(zip(*rows, strict=True)))

    def left(self, module: MimiConv1d, x: torch.Tensor) -> torch.Tensor:
        column = next(self.incoming)
        if all(left is not None for left in column):
            return column[0] if len(column) == 1 else torch.cat(column)
        padding = int(module.padding_total)
        return torch.cat([
            left if left is not None
            else x[row : row + 1, :, :1].expand(-1, -1, padding) if module.pad_mode == "replicate"
            else x.new_zeros(1, x.shape[1], padding)
            for row, left in enumerate(column)
        ])


class MimiStreamDecoder:
    """Streaming `MimiModel.decode`: codes (B, Q, T) -> audio (B, channels, T * frame_size)."""

    def __init__(self, mimi: nn.Module):
        config = mimi.config
        if not config.use_causal_conv or config.trim_right_ratio != 1.0:
            raise ValueError("streaming decode needs causal convs trimmed on the right")
        self.mimi = mimi
        self.frame_samples = int(config.frame_size)
        self.upsample, self.transformer, self.seanet = _decoder_parts(mimi)
        self._carried = list(_carried_convs(self.seanet.layers))
        if self.upsample is not None:
            self._carried.insert(0, self.upsample)
        for module in self._carried:
            if isinstance(module, MimiConv1d) and (
                module.pad_mode != "constant" or module.conv.stride[0] != 1
            ):
                raise ValueError("streaming decode supports stride-1 zero-padded convs only")

    def new_state(self) -> MimiDecodeState:
        param = next(self.mimi.parameters())
        convs = []
        for module in self._carried:
            if isinstance(module, MimiConv1d):
                shape = (1, module.in_channels, int(module.padding_total))
            else:
                conv = module.conv
                shape = (1, conv.out_channels, conv.kernel_size[0] - conv.stride[0])
            convs.append(torch.zeros(shape, dtype=param.dtype, device=param.device))
        return MimiDecodeState(convs, _new_kv(self.transformer, param.dtype, param.device))

    @torch.inference_mode()
    def decode(self, states: list[MimiDecodeState], codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[0] != len(states):
            raise ValueError(f"{len(states)} states for a batch of {codes.shape[0]}")
        columns = zip(*(s.convs for s in states), strict=True)
        carry = _Carry([column[0] if len(column) == 1 else torch.cat(column) for column in columns])
        hidden = _dequantize(self.mimi.quantizer, codes)
        if self.upsample is not None:
            hidden = _transposed(self.upsample, hidden, carry)
        hidden = _transformer_step(self.transformer, hidden.transpose(1, 2), [s.kv for s in states])
        audio = _run(self.seanet.layers, hidden.transpose(1, 2), carry)
        for row, state in enumerate(states):
            state.convs = [t[row : row + 1].clone() for t in carry.outgoing]
        return audio


def _dequantize(quantizer: nn.Module, codes: torch.Tensor) -> torch.Tensor:
    """`MimiSplitResidualVectorQuantizer.decode`: codes (B, Q, T) -> (B, D, T), summed in the
    same order, without its per-codebook module and layout calls."""
    semantic = quantizer.num_semantic_quantizers
    out = _residual_sum(quantizer.semantic_residual_vector_quantizer, codes[:, :semantic])
    if codes.shape[1] > semantic:
        out = out + _residual_sum(quantizer.acoustic_residual_vector_quantizer, codes[:, semantic:])
    return out


def _residual_sum(rvq: nn.Module, codes: torch.Tensor) -> torch.Tensor:
    total = F.embedding(codes[:, 0], rvq.layers[0].codebook.embed)
    for index in range(1, codes.shape[1]):
        total = total + F.embedding(codes[:, index], rvq.layers[index].codebook.embed)
    total = total.transpose(1, 2)
    return total if rvq.output_proj is None else F.conv1d(total, rvq.output_proj.weight)


def _carried_convs(layers):
    """The convs of a SEANet decoder that carry state, in the order `_run` meets them."""
    for layer in layers:
        if isinstance(layer, (MimiConv1d, MimiConvTranspose1d)):
            yield layer
        elif isinstance(layer, MimiResnetBlock):
            yield from _carried_convs(layer.block)
            if isinstance(layer.shortcut, MimiConv1d):
                yield layer.shortcut


def _run(layers, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
    for layer in layers:
        if isinstance(layer, MimiConv1d):
            x = _causal(layer, x, carry)
        elif isinstance(layer, MimiConvTranspose1d):
            x = _transposed(layer, x, carry)
        elif isinstance(layer, MimiResnetBlock):
            residual = x
            x = _run(layer.block, x, carry)
            if isinstance(layer.shortcut, MimiConv1d):
                residual = _causal(layer.shortcut, residual, carry)
            x = residual + x
        else:
            x = layer(x)
    return x


def _causal(module: MimiConv1d, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
    # Whole frames in: the next output window starts `padding_total` inputs before the end.
    left = carry.left(module, x)
    if left.shape[-1]:
        x = torch.cat([left, x], dim=-1)
    carry.outgoing.append(x[..., x.shape[-1] - left.shape[-1] :])
    conv = module.conv
    # On CPU, a conv over a few steps with a big kernel takes torch's slow im2col path (~7x
    # slower at Mimi's 25 Hz layer); one GEMM with the weight as the large operand does not.
    if conv.groups == 1 and conv.weight.numel() > 16 * x[0].numel():
        return _conv_as_linear(x, conv)
    return conv(x)


def _transposed(module: MimiConvTranspose1d, x: torch.Tensor, carry: _Carry) -> torch.Tensor:
    conv = module.conv
    stride = conv.stride[0]
    tail = next(carry.incoming)
    y = _overlap_add(x, conv.weight, stride, conv.groups)
    y[..., : tail.shape[-1]] += tail
    keep = x.shape[-1] * stride
    carry.outgoing.append(y[..., keep:])
    y = y[..., :keep]
    return y if conv.bias is None else y + conv.bias[:, None]


def _conv_as_linear(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """`conv(x)` (no padding) as unfold + one `F.linear`."""
    out_channels, in_channels, kernel = conv.weight.shape
    dilation = conv.dilation[0]
    cols = x.unfold(-1, (kernel - 1) * dilation + 1, conv.stride[0])[..., ::dilation]
    cols = cols.transpose(1, 2).reshape(x.shape[0], cols.shape[2], in_channels * kernel)
    weight = conv.weight.view(out_channels, in_channels * kernel)
    return F.linear(cols, weight, conv.bias).transpose(1, 2)


def _overlap_add(
    x: torch.Tensor, weight: torch.Tensor, stride: int, groups: int = 1
) -> torch.Tensor:
    """`conv_transpose1d(x, weight, stride=stride, groups=groups)` as one (grouped) matmul plus
    overlap-add.

    On CPU, torch sends a transposed conv over a few input steps to its slow im2col path, which
    costs as much for 2 steps as for 50 (and a grouped one, Mimi's upsampling, more still); a
    matmul keeps the cost proportional to the input.
    """
    batch, in_channels, length = x.shape
    per_group, kernel = weight.shape[1], weight.shape[2]
    channels = per_group * groups
    pieces = -(-kernel // stride)
    grouped = x.reshape(batch, groups, in_channels // groups, length).transpose(2, 3)
    cols = grouped @ weight.view(groups, in_channels // groups, per_group * kernel)
    cols = cols.view(batch, groups, length, per_group, kernel).transpose(1, 2)
    cols = cols.reshape(batch, length, channels, kernel)
    if pieces * stride != kernel:
        cols = F.pad(cols, (0, pieces * stride - kernel))
    cols = cols.view(batch, length, channels, pieces, stride).permute(0, 2, 3, 1, 4)
    y = cols.new_zeros(batch, channels, length + pieces - 1, stride)
    for piece in range(pieces):
        y[:, :, piece : piece + length] += cols[:, :, piece]
    return y.view(batch, channels, -1)[..., : (length - 1) * stride + kernel]


@dataclass
class MimiEncodeState:
    """One session's encoder carry: the last inputs of each conv (None before its first frame),
    and the transformer KV."""

    convs: list[torch.Tensor | None]
    kv: SlidingKV

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.convs) + self.kv.nbytes

    def release(self) -> None:
        self.convs = [None] * len(self.convs)
        self.kv.release()


class MimiStreamEncoder:
    """Streaming `MimiModel.encode`: audio (B, channels, k * frame_size) -> codes (B, Q, k).

    The convs run as the decoder's do (each carries its last inputs; a strided conv given whole
    frames ends its windows exactly there), which is what transformers' `MimiConv1dPaddingCache`
    path computes, without its per-layer padding arithmetic."""

    def __init__(self, mimi: nn.Module, num_quantizers: int | None = None):
        self.mimi = mimi
        self.num_quantizers = num_quantizers
        self.frame_samples = int(mimi.config.frame_size)
        self.seanet, self.transformer, self.downsample = _encoder_parts(mimi)
        self._carried = [*_carried_convs(self.seanet.layers), self.downsample]

    def new_state(self) -> MimiEncodeState:
        param = next(self.mimi.parameters())
        convs = [None] * len(self._carried)
        return MimiEncodeState(convs, _new_kv(self.transformer, param.dtype, param.device))

    @torch.inference_mode()
    def encode(self, states: list[MimiEncodeState], audio: torch.Tensor) -> torch.Tensor:
        if audio.shape[0] != len(states):
            raise ValueError(f"{len(states)} states for a batch of {audio.shape[0]}")
        if audio.shape[-1] % self.frame_samples:
            raise ValueError(f"chunks must be whole frames of {self.frame_samples} samples")
        carry = _EncodeCarry([s.convs for s in states])
        hidden = _run(self.seanet.layers, audio, carry)
        hidden = _transformer_step(self.transformer, hidden.transpose(1, 2), [s.kv for s in states])
        latents = _causal(self.downsample, hidden.transpose(1, 2), carry)
        for row, state in enumerate(states):
            state.convs = [t[row : row + 1].clone() for t in carry.outgoing]
        return _quantize(self.mimi.quantizer, latents, self.num_quantizers)


def _quantize(quantizer: nn.Module, latents: torch.Tensor, count: int | None) -> torch.Tensor:
    """`MimiSplitResidualVectorQuantizer.encode` (B, D, T) -> codes (B, Q, T): the same
    projections, distances and residuals, without its per-codebook module and layout calls."""
    count = quantizer.max_num_quantizers if count is None else count
    semantic = quantizer.num_semantic_quantizers
    codes = _residual_codes(quantizer.semantic_residual_vector_quantizer, latents, semantic)
    if count > semantic:
        codes += _residual_codes(
            quantizer.acoustic_residual_vector_quantizer, latents, count - semantic
        )
    return torch.stack(codes, dim=1)


def _residual_codes(rvq: nn.Module, latents: torch.Tensor, count: int) -> list[torch.Tensor]:
    if rvq.input_proj is not None:
        latents = F.conv1d(latents, rvq.input_proj.weight)
    residual = latents.transpose(1, 2)
    batch, frames, dim = residual.shape
    codes = []
    for index in range(count):
        embed = rvq.layers[index].codebook.embed
        flat = residual.reshape(-1, dim)
        nearest = torch.cdist(flat[None].float(), embed[None].float(), p=2)[0].argmin(dim=-1)
        residual = residual - F.embedding(nearest, embed).view(batch, frames, dim)
        codes.append(nearest.view(batch, frames))
    return codes
