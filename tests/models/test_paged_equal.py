"""The two ways attention reads the paged KV give the same replies: FlexAttention over the blocks
in place (the GPU's path, uneager here) and the gather (the CPU's), through a conversation with
contexts of mixed lengths, a system turn from the prefix cache, a voiced reply, a barge-in and
cancel, a reused slot, a resumed reply and a context cut by truncation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.base import ReplyTurn, TextTurn
from models.qwen3_omni.adapter import Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.tiny import load_preprocessor
from models.reply import ReplySpec

pytestmark = pytest.mark.cpu_bound

OPTIONS = Qwen3OmniOptions(min_text_tokens=4, max_text_tokens=8, min_frames=3, max_frames=6,
                           max_context=160, talker_context=64)
VOICED, TEXT = ReplySpec(temperature=0.0), ReplySpec(audio=False, temperature=0.0)
LOGITS_TOLERANCE = 1e-4
"""Between the two paths (float32): the same sums in another order."""


@pytest.fixture(scope="module")
def make(tiny_omni_dir):
    loaded = Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)
    prep = load_preprocessor(tiny_omni_dir, loaded.model.config)

    def build(attention: str) -> Qwen3OmniAdapter:
        # A small pool: uncompiled FlexAttention scores every query against all of it.
        return Qwen3OmniAdapter(loaded.model, loaded.tokenizer, prep, options=OPTIONS,
                                kv_memory=1e6, kv_attention=attention)

    return build


def speech(seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(16000)).astype(np.float32)


def prefill(ad, states, items) -> None:
    """One prefill call per input, every session's k-th input in the k-th call."""
    for k in range(max(len(i) for i in items)):
        row = [i[k] if k < len(i) else None for i in items]
        audio = [j for j, x in enumerate(row) if isinstance(x, np.ndarray)]
        if audio:
            for j, feat in zip(audio, ad.encode_audio([states[j] for j in audio],
                                                      [row[j] for j in audio]), strict=True):
                row[j] = feat
        ad.thinker_prefill(states, [TextTurn(x) if isinstance(x, str) else x for x in row])


def reply(ad, states, specs, steps: int = 40) -> dict:
    """Replies of `states` run together for `steps` steps: each one's token ids, codes, finish
    reason, usage."""
    for st, spec in zip(states, specs, strict=True):
        ad.begin_response(st, spec)
    out = {st.session_id: {"ids": [], "codes": [], "reason": None, "usage": None}
           for st in states}
    voiced = [st for st, spec in zip(states, specs, strict=True) if spec.audio]
    for _ in range(steps):
        tokens = ad.thinker_decode(states)
        for st, tok in zip(states, tokens, strict=True):
            rec = out[st.session_id]
            if tok.token_id is not None:
                rec["ids"].append(tok.token_id)
            rec["reason"] = rec["reason"] or tok.reason
            rec["usage"] = rec["usage"] or tok.usage
        if voiced:
            by_id = dict(zip((s.session_id for s in states), tokens, strict=True))
            frames = ad.talker_step(voiced, [by_id[s.session_id] for s in voiced])
            for st, frame in zip(voiced, frames, strict=True):
                if frame.codes is not None:
                    out[st.session_id]["codes"].append(frame.codes.tolist())
    return out


def conversation(ad: Qwen3OmniAdapter) -> tuple[list, list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    hook = ad.model.thinker.lm_head.register_forward_hook(
        lambda _m, _i, out: logits.append(out.detach().clone()))
    said = []
    try:
        a, b, c = (ad.new_state(sid) for sid in "abc")
        ad.instruct(c, "Be brief and kind.", ())
        prefill(ad, [a, b, c], [["a long opening line " * 3, speech(1)], ["hi"],
                                ["and some text"]])
        said.append(reply(ad, [a, b, c], [VOICED, TEXT, TEXT]))
        # Barge-in: new input during a's reply ends its text; the reply is cancelled.
        said.append(reply(ad, [a], [VOICED], steps=3))
        prefill(ad, [a], [["wait, one more thing"]])
        ad.reset_response(a)
        # b leaves; d takes its slot and the blocks it gave back.
        ad.free(b)
        d = ad.new_state("d")
        prefill(ad, [d], [["a new caller"]])
        # e resumes a's first reply as heard, on another node.
        e = ad.new_state("e")
        heard = tuple(said[0]["a"]["ids"])
        prefill(ad, [e], [["a long opening line " * 3, ReplyTurn(heard), "go on"]])
        # c talks past max_context: its context is cut (auto).
        prefill(ad, [c], [["x" * 90, "y" * 60]])
        said.append(reply(ad, [a, c, d, e], [TEXT, VOICED, TEXT, TEXT]))
        assert said[-1]["c"]["usage"]["truncated_tokens"] > 0
        for st in (a, c, d, e):
            ad.free(st)
        # What is left is the prefix cache's: c's system turn.
        pool = ad._pools.thinker
        assert pool.blocks_used * pool.block_bytes == ad.prefix_cache.stats().bytes > 0
        assert ad._pools.talker.blocks_used == 0
    finally:
        hook.remove()
    return said, logits


def test_flex_and_gather_give_the_same_replies(make):
    flex_said, flex_logits = conversation(make("flex"))
    gather_said, gather_logits = conversation(make("gather"))
    assert flex_said == gather_said
    assert all(r["ids"] for turn in gather_said for r in turn.values())
    assert gather_said[0]["a"]["codes"] and gather_said[-1]["c"]["codes"]
    assert len(flex_logits) == len(gather_logits)
    worst = max((f - g).abs().max().item() for f, g in zip(flex_logits, gather_logits,
                                                           strict=True))
    assert worst < LOGITS_TOLERANCE
