"""Phase 2: does the serving dtype compute what fp32 computes, and does batching change a reply?

One model at the real widths (a few layers; the tiny model on the CPU) is built in fp32 and
copied to bf16, so both hold the same weights:

- Thinker hidden states, bf16 against fp32: relative error, worst cosine, and how often the
  head's top token agrees.
- Greedy replies batched against the same replies alone, in the serving dtype (bf16 on a GPU):
  tokens and codec frames, up to the first difference. bf16 MoE routing may flip near-tied
  experts between batch sizes (GPU.md 9), so this is a figure, not a pass.
- Code2Wav bf16 against fp32: SNR of the waveform from the same codes.
- CUDA graphs against eager: greedy replies of four sessions (a bucket of four, its graphs
  captured at the adapter's warm-up) through the Thinker's and Talker's decode graphs and the
  code predictor's, against the same replies on the eager path (on the CPU, the graphs' fixed
  buffers without a capture); and one sampled frame of the code predictor's captured graph
  against the same loop run eagerly on the same noise (GPU only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from duplex.gpucheck import build
from duplex.gpucheck.measure import is_cuda
from duplex.gpucheck.profile import Profile
from duplex.gpucheck.record import PhaseRecord
from models.base import TextTurn
from models.cuda_graphs import graph_settings
from models.qwen3_omni.adapter import Qwen3OmniOptions, Sampling
from models.qwen3_omni.codec import offline_decode
from models.qwen3_omni.compat import thinker_parts
from models.qwen3_omni.graphs import StaticResidual, residual_graphs
from models.qwen3_omni.options import Stream, counters

PROMPTS = (
    "hello there",
    "what is the weather like in lisbon today",
    "tell me a story about a dragon who could not fly",
    "one two three",
)
"""Of different lengths, so the batched prefill pads."""


def greedy(steps: int) -> Qwen3OmniOptions:
    return Qwen3OmniOptions(
        min_text_tokens=steps, max_text_tokens=steps, min_frames=steps, max_frames=steps + 1,
        talker_sampling=Sampling(0.0), residual_sampling=Sampling(0.0),
    )


def run(profile: Profile, record: PhaseRecord) -> None:
    serving = against_fp32(profile, record)
    record.attempt("batched vs alone", lambda: batched_vs_alone(record, profile, serving))
    record.attempt("graph vs eager", lambda: graph_vs_eager(record, profile, serving))
    record.attempt("graph vs eager, sampled", lambda: graph_vs_static(record, profile, serving))


def against_fp32(profile: Profile, record: PhaseRecord):
    """The bf16 figures against fp32; returns the model in the serving dtype (the other one
    is let go): the replies are compared as they would be served."""
    layers = profile.correctness_layers if profile.shaped else None
    reference = build.model(profile, torch.float32, layers)
    low = build.twin(reference, torch.bfloat16)
    shape = f"shaped, {layers} layers" if profile.shaped else "tiny"
    record.set("model", f"{shape} on {profile.device}, replies in {profile.dtype}")
    record.attempt("thinker bf16 vs fp32", lambda: thinker_vs_fp32(record, reference, low))
    record.attempt("code2wav bf16 vs fp32",
                   lambda: code2wav_vs_fp32(record, reference, low, profile.codec_frames))
    return low if profile.dtype == "bfloat16" else reference


@torch.inference_mode()
def thinker_vs_fp32(record: PhaseRecord, reference, low) -> None:
    vocab = reference.config.thinker_config.text_config.vocab_size
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    ids = ids.to(reference.device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand(3, *ids.shape)
    hidden = {}
    for name, model in (("fp32", reference), ("bf16", low)):
        out = thinker_parts(model).text(input_ids=ids, position_ids=positions, use_cache=False)
        hidden[name] = out.last_hidden_state
    high, rounded = hidden["fp32"], hidden["bf16"].float()
    record.set("thinker hidden bf16 vs fp32: relative error",
               round(float((rounded - high).norm() / high.norm()), 5))
    record.set("thinker hidden bf16 vs fp32: worst cosine",
               round(float(F.cosine_similarity(rounded, high, dim=-1).min()), 5))
    top_high = reference.thinker.lm_head(high).argmax(-1)
    top_low = low.thinker.lm_head(hidden["bf16"]).argmax(-1)
    record.set("thinker top token bf16 = fp32 (share of positions)",
               round(float((top_high == top_low).float().mean()), 4))


@torch.inference_mode()
def code2wav_vs_fp32(record: PhaseRecord, reference, low, frames: int) -> None:
    config = reference.config.code2wav_config
    codes = torch.randint(0, config.codebook_size, (1, config.num_quantizers, frames),
                          generator=torch.Generator().manual_seed(1)).to(reference.device)
    high = offline_decode(reference.code2wav, codes).float()
    rounded = offline_decode(low.code2wav, codes).float()
    noise = float(((rounded - high) ** 2).sum())
    record.set(f"code2wav bf16 vs fp32 SNR dB ({frames} frames)",
               round(10 * math.log10(float((high**2).sum()) / noise), 2) if noise else math.inf)


def _reply(adapter, sids: list[str], prompts: list[str], steps: int):
    """Greedy reply steps of these sessions together -> (tokens, frames) per session."""
    states = [adapter.new_state(sid) for sid in sids]
    adapter.thinker_prefill(states, [TextTurn(p) for p in prompts])
    for state in states:
        adapter.begin_response(state)
    tokens: list[list[int | None]] = [[] for _ in states]
    frames: list[list[list[int] | None]] = [[] for _ in states]
    for _ in range(steps):
        said = adapter.thinker_decode(states)
        voiced = adapter.talker_step(states, said)
        for i, (tok, frame) in enumerate(zip(said, voiced, strict=True)):
            tokens[i].append(tok.token_id)
            frames[i].append(None if frame.codes is None else frame.codes.tolist())
    for state in states:
        adapter.free(state)
    return tokens, frames


def _agreeing(a: list, b: list) -> float:
    """Share of the steps before the first difference."""
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / len(a)


def batched_vs_alone(record: PhaseRecord, profile: Profile, low) -> None:
    steps = profile.reply_steps
    model = build.adapter(low, profile, greedy(steps))
    sids = [f"greedy-{i}" for i in range(len(PROMPTS))]
    alone = [_reply(model, [sid], [prompt], steps) for sid, prompt in zip(sids, PROMPTS,
                                                                          strict=True)]
    tokens, frames = _reply(model, sids, list(PROMPTS), steps)
    record.set(f"greedy tokens batched = alone (B={len(PROMPTS)}, share of {steps} steps)",
               round(sum(_agreeing(t, a[0][0]) for t, a in zip(tokens, alone, strict=True))
                     / len(PROMPTS), 3))
    record.set(f"greedy frames batched = alone (B={len(PROMPTS)}, share of {steps} steps)",
               round(sum(_agreeing(f, a[1][0]) for f, a in zip(frames, alone, strict=True))
                     / len(PROMPTS), 3))


def graph_vs_eager(record: PhaseRecord, profile: Profile, low) -> None:
    steps, batch = profile.reply_steps, len(PROMPTS)
    sids = [f"graph-{i}" for i in range(batch)]
    replies, stats = {}, {}
    for graphs in (True, False):
        adapter = build.adapter(low, profile, greedy(steps), graphs=graphs)
        adapter.warm_up(batch)
        replies[graphs] = _reply(adapter, sids, list(PROMPTS), steps)
        stats[graphs] = adapter.graph_stats()
    # On the CPU nothing is captured: the graphed side runs the graphs' fixed buffers.
    how = "replays" if is_cuda(profile.device) else "static"
    record.set(f"decode steps run as {how} (thinker, talker, code predictor)",
               ", ".join(str(stats[True][stage][how])
                         for stage in ("thinker", "talker", "code_predictor")))
    (tokens, frames), (eager_tokens, eager_frames) = replies[True], replies[False]
    record.set(f"greedy tokens graphed = eager (B={batch}, share of {steps} steps)",
               round(sum(_agreeing(t, e) for t, e in zip(tokens, eager_tokens, strict=True))
                     / batch, 3))
    record.set(f"greedy frames graphed = eager (B={batch}, share of {steps} steps)",
               round(sum(_agreeing(f, e) for f, e in zip(frames, eager_frames, strict=True))
                     / batch, 3))


@torch.inference_mode()
def graph_vs_static(record: PhaseRecord, profile: Profile, low) -> None:
    talker = low.talker
    predictor, embed = talker.code_predictor, talker.get_input_embeddings()
    codes = low.config.talker_config.num_code_groups
    sampling = Qwen3OmniOptions().residual_sampling
    dtype = next(predictor.parameters()).dtype
    runner = residual_graphs(predictor, embed, codes, sampling, profile.device, dtype,
                             graph_settings(True, False, profile.device))
    figure = "sampled frame graphed = eager (B=8, share of codes)"
    if runner is None:
        record.set(figure, "needs CUDA")
        return
    if not runner.warm_up(8):
        raise RuntimeError("the CUDA graph capture failed (see the log)")
    rng = torch.Generator().manual_seed(2)
    hidden = torch.randn(8, predictor.config.hidden_size, generator=rng)
    hidden = hidden.to(profile.device, dtype)
    first = torch.randint(0, predictor.config.vocab_size, (8,), generator=rng).to(profile.device)
    counts = counters([Stream(i) for i in range(8)], profile.device)
    greedy_rows = torch.zeros(8, dtype=torch.bool, device=profile.device)
    graphed, how = runner(hidden, first, counts, greedy_rows)
    if how != "replays":
        raise RuntimeError(f"the frame ran {how}, not from a captured graph")
    eager = StaticResidual(predictor, embed, codes, 8, sampling, profile.device, dtype)
    eager.load(hidden, first, counts, greedy_rows)
    eager.run()
    record.set(figure, round(float((graphed == eager.codes).float().mean()), 4))
