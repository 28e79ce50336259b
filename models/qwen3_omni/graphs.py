"""The code predictor's per-frame loop as one CUDA graph (`engine.cuda_graphs`).

Every codec frame runs the code predictor Q-1 times in sequence (15 in the real model), each a
forward of a few layers over one position and a sample: hundreds of small kernel launches per
frame whose shapes never change. vLLM-Omni cut a duplex step from 77.5 to 30.2 ms by replaying
such steps as CUDA graphs (PR #6604). A graph needs every tensor at a fixed address and no host
sync, so `StaticResidual` runs the loop in fixed buffers only:

- keys and values of each layer in a (B, kv_heads, Q, head_dim) buffer (the loop's positions
  0..Q-1), written at fixed positions, and an explicit mask per step;
- sampling by the Gumbel-max trick over the same filtered logits as `sample` (temperature,
  top-k, top-p), with the uniform noise hashed on the device, inside the graph, from each
  session's key and count of draws (`options.Stream`): the same distribution as the eager
  path's inverse CDF, not the same draws. A row can be greedy (a reply at temperature 0): it
  takes the argmax and draws nothing.

`StaticResidual` runs eagerly anywhere (the CPU tests check it against the eager path);
`GraphedResidual` captures one graph per batch bucket when the engine starts (`warm_up`,
`models.cuda_graphs`), and falls back to the eager path for a batch no captured bucket holds or
after a failed capture. On a CPU model nothing here runs unless `static_steps` asks for the
fixed buffers without a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.cuda_graphs import BucketGraphs, GraphPool, GraphSettings
from models.qwen3_omni import compat
from models.qwen3_omni.options import NOISE_MAX, Sampling, filtered, uniform32


class _StaticKV:
    """The `cache=` object of the code predictor in fixed buffers: `at` says where the next
    forward's positions go, and every layer's update writes them there."""

    def __init__(self, layers: int, batch: int, heads: int, length: int, head_dim: int,
                 device, dtype) -> None:
        shape = (batch, heads, length, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.at: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.at, key.to(keys.dtype))
        values.index_copy_(2, self.at, value.to(values.dtype))
        return keys, values


class StaticResidual:
    """Codebooks 1..Q-1 of one frame for `batch` rows, every tensor allocated up front.

    Inputs: `hidden` (B, H) the Talker's last hidden state, `first` (B,) codebook 0, `counts`
    (2, B) each row's stream key and draws so far, `greedy` (B,) rows that take the argmax.
    Output: `codes` (B, Q). `run` reads the inputs and writes the output in place, so a graph
    of `run` replays on whatever the inputs hold.
    """

    def __init__(self, predictor, talker_embed, num_codes: int, batch: int,
                 sampling: Sampling, device, dtype) -> None:
        config = predictor.config
        self.predictor, self.talker_embed = predictor, talker_embed
        self.num_codes, self.batch, self.sampling = num_codes, batch, sampling
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.kv = _StaticKV(config.num_hidden_layers, batch, config.num_key_value_heads,
                            num_codes, head_dim, device, dtype)
        self.hidden = torch.zeros(batch, config.hidden_size, device=device, dtype=dtype)
        self.first = torch.zeros(batch, dtype=torch.long, device=device)
        self.counts = torch.zeros(2, batch, dtype=torch.long, device=device)
        self.greedy = torch.zeros(batch, dtype=torch.bool, device=device)
        self.vocab = config.vocab_size
        self.codes = torch.zeros(batch, num_codes, dtype=torch.long, device=device)
        # Step 0 feeds positions 0 and 1 (the hidden state, codebook 0); step k>0 position k+1.
        self._at = [torch.arange(2, device=device)] + [
            torch.tensor([k + 1], device=device) for k in range(1, num_codes - 1)
        ]
        slots = torch.arange(num_codes, device=device)
        self._masks = []
        for at in self._at:
            mask = torch.zeros(batch, 1, at.numel(), num_codes, device=device, dtype=dtype)
            mask.masked_fill_(slots[None, :] > at[:, None], torch.finfo(dtype).min)
            self._masks.append({"full_attention": mask})

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            "hidden": tuple(self.hidden.shape),
            "first": tuple(self.first.shape),
            "counts": tuple(self.counts.shape),
            "greedy": tuple(self.greedy.shape),
            "codes": tuple(self.codes.shape),
            "kv": tuple(self.kv.keys[0].shape),
        }

    def load(self, hidden: torch.Tensor, first: torch.Tensor, counts: torch.Tensor,
             greedy: torch.Tensor) -> None:
        """Copy a batch of `hidden.shape[0]` rows in (device to device); rows past it keep what
        they held (discarded)."""
        n = hidden.shape[0]
        self.hidden[:n].copy_(hidden)
        self.first[:n].copy_(first)
        self.counts[:, :n].copy_(counts)
        self.greedy[:n].copy_(greedy)

    def run(self) -> None:
        predictor = self.predictor
        embeds = predictor.get_input_embeddings()
        noise = None
        if self.sampling.temperature > 0:
            draws = gumbel_draws(self.num_codes, self.vocab)
            noise = uniform32(self.counts, draws).view(self.batch, self.num_codes - 1, -1)
        x = torch.stack([self.hidden, self.talker_embed(self.first)], dim=1)
        self.codes[:, 0].copy_(self.first)
        for k in range(self.num_codes - 1):
            if k:
                x = embeds[k - 1](self.codes[:, k])[:, None]
            at = self._at[k]
            self.kv.at = at
            h = predictor.model(
                inputs_embeds=x,
                attention_mask=self._masks[k],
                position_ids=at[None].expand(self.batch, -1),
                **{compat.CODE_PREDICTOR_CACHE: self.kv},
                use_cache=True,
            ).last_hidden_state
            logits = predictor.lm_head[k](h[:, -1]).float()
            code = logits.argmax(-1)
            if noise is not None:
                code = torch.where(self.greedy, code, gumbel_draw(logits, noise[:, k], self.sampling))
            self.codes[:, k + 1].copy_(code)


def gumbel_draws(num_codes: int, vocab: int) -> int:
    """Draws a sampled row takes per frame in the graph: a uniform per code and candidate."""
    return (num_codes - 1) * vocab


def gumbel_draw(logits: torch.Tensor, noise: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(B, V) logits and (B, V) uniform noise -> (B,) ids drawn as `sample` draws them, without
    a host sync: argmax(logits + Gumbel noise) is a draw from softmax(logits). Noise is held
    inside (0, 1): at 1.0 the Gumbel term is +inf, and on a filtered (-inf) token NaN, which
    argmax would pick."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    noise = noise.clamp(min=torch.finfo(noise.dtype).tiny, max=NOISE_MAX)
    gumbel = -torch.log(-torch.log(noise))
    return (filtered(logits, sampling) + gumbel).argmax(-1)


class GraphedResidual(BucketGraphs):
    """`StaticResidual` per batch bucket, captured as one CUDA graph each at `warm_up` (or run
    from its buffers without one when not `capture`).

    Calling it returns (B, Q) codes for a batch it `holds`, and how they ran; the eager path
    runs the others.
    """

    def __init__(self, make: Callable[[int], StaticResidual], capture: bool = True,
                 pool: GraphPool | None = None) -> None:
        super().__init__("code predictor", make, capture, pool)

    def __call__(self, hidden: torch.Tensor, first: torch.Tensor, counts: torch.Tensor,
                 greedy: torch.Tensor) -> tuple[torch.Tensor, str]:
        batch = hidden.shape[0]
        static = self.static(batch)
        static.load(hidden, first, counts, greedy)
        how = self.run(batch)
        return static.codes[:batch].clone(), how


def residual_graphs(predictor, talker_embed, num_codes: int, sampling: Sampling,
                    device, dtype, settings: GraphSettings) -> GraphedResidual | None:
    """The fixed-buffer runner when `settings` asks for one; None otherwise, and then nothing
    of this module touches the model."""
    if not settings.static:
        return None
    return GraphedResidual(
        lambda batch: StaticResidual(predictor, talker_embed, num_codes, batch, sampling,
                                     device, dtype),
        settings.capture, settings.pool,
    )
