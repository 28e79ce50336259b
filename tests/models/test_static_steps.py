"""The Thinker's and Talker's decode steps run from the fixed buffers a CUDA graph of them holds
(`static_steps`, `models.paged_static`) give the eager path's replies, token for token and code
for code, greedy on tiny-omni: batches padded up to their bucket, sessions joining and leaving
between steps, a step that takes a new block, a system turn shared from the prefix cache, and a
context rewound (`PagedKV.truncate`) and laid again. The replay itself needs a GPU; these are
the buffers and the padding it replays."""

from __future__ import annotations

import numpy as np
import pytest

from models.base import Mark, Rewind, TextTurn
from models.paged_kv import BLOCK_SIZE
from models.qwen3_omni.adapter import STATE_KEY, Qwen3OmniAdapter, Qwen3OmniOptions
from models.qwen3_omni.tiny import load_preprocessor
from models.reply import ReplySpec

OPTIONS = Qwen3OmniOptions(min_text_tokens=6, max_text_tokens=10, min_frames=3, max_frames=8,
                           max_context=256, talker_context=64)
VOICED, TEXT = ReplySpec(temperature=0.0), ReplySpec(audio=False, temperature=0.0)
REPLY_OPENING = 5
"""Positions a reply's first step forwards after the user's last (the user turn's end and the
assistant prefix): its second step writes the first token there."""


@pytest.fixture(scope="module")
def make(tiny_omni_dir):
    loaded = Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS)
    prep = load_preprocessor(tiny_omni_dir, loaded.model.config)

    def build(static: bool) -> Qwen3OmniAdapter:
        adapter = Qwen3OmniAdapter(loaded.model, loaded.tokenizer, prep, options=OPTIONS,
                                   kv_memory=4e6, kv_attention="gather", static_steps=static)
        adapter.warm_up(4)
        return adapter

    return build


def speech(seed: int) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(16000)).astype(np.float32)


def lay(ad, states, items) -> None:
    """One prefill call per input, every session's k-th input in the k-th call."""
    for k in range(max(len(i) for i in items)):
        row = [i[k] if k < len(i) else None for i in items]
        audio = [j for j, x in enumerate(row) if isinstance(x, np.ndarray)]
        for j, feat in zip(audio, ad.encode_audio([states[j] for j in audio],
                                                  [row[j] for j in audio]), strict=True):
            row[j] = feat
        ad.thinker_prefill(states, [TextTurn(x) if isinstance(x, str) else x for x in row])


class Transcript:
    """What each session said, and what the steps were like."""

    def __init__(self, ad: Qwen3OmniAdapter) -> None:
        self.ad = ad
        self.said: dict[str, dict[str, list]] = {}
        self.widths: list[int] = []
        """Rows of each decode step."""
        self.crossed = False
        """Whether a decode step wrote the first position of a new block."""

    def step(self, states, voiced) -> None:
        ad, pool = self.ad, self.ad._pools.thinker
        before = {st.session_id: _length(pool, st) for st in states}
        tokens = ad.thinker_decode(states)
        stepped = 0
        for st, tok in zip(states, tokens, strict=True):
            rec = self.said.setdefault(st.session_id, {"ids": [], "codes": []})
            if tok.token_id is not None:
                rec["ids"].append(tok.token_id)
                grew = _length(pool, st) - before[st.session_id]
                if grew == 1:
                    stepped += 1
                    self.crossed |= before[st.session_id] % BLOCK_SIZE == 0
        self.widths.append(stepped)
        by_id = dict(zip((s.session_id for s in states), tokens, strict=True))
        talking = [st for st in states if st.session_id in voiced]
        if talking:
            frames = ad.talker_step(talking, [by_id[s.session_id] for s in talking])
            for st, frame in zip(talking, frames, strict=True):
                if frame.codes is not None:
                    self.said[st.session_id]["codes"].append(frame.codes.tolist())


def _length(pool, state) -> int:
    slot = state.slots[STATE_KEY].thinker_slot
    return 0 if slot is None else pool.length[slot]


def conversation(ad: Qwen3OmniAdapter) -> Transcript:
    out = Transcript(ad)
    pool = ad._pools.thinker
    a, b, c = (ad.new_state(sid) for sid in "abc")
    for st in (b, c):
        ad.instruct(st, "Be brief and kind.", ())
    lay(ad, [a, b, c], [["a long opening line " * 3, speech(1)], ["hi"], ["and some text"]])
    # a's reply starts a few positions before a block ends: its steps take the next block.
    pad = -(_length(pool, a) + REPLY_OPENING + 2) % BLOCK_SIZE
    if pad:
        lay(ad, [a], [["." * pad]])
    live, voiced = [a, b], {"a", "c"}
    ad.begin_response(a, VOICED)
    ad.begin_response(b, TEXT)
    for k in range(12):
        if k == 2:
            # c joins two steps in: three rows in a bucket of four.
            live.append(c)
            ad.begin_response(c, VOICED)
        if k == 4:
            # d joins, its system turn from the prefix cache: four rows.
            d = ad.new_state("d")
            ad.instruct(d, "Be brief and kind.", ())
            lay(ad, [d], [["a new caller"]])
            live.append(d)
            ad.begin_response(d, TEXT)
        if k == 7:
            # b leaves mid-reply: three rows again, the fourth of the bucket padding where d's
            # row was.
            live.remove(b)
            ad.free(b)
        out.step(live, voiced)
    # a's context goes back to a mark and is laid again from there, beside c's next reply.
    lay(ad, [a, c], [[Mark(1), "one more thing"], ["go on"]])
    for st in (a, c):
        ad.begin_response(st, TEXT)
    for _ in range(6):
        out.step([a, c], set())
    cut = _length(pool, a)
    lay(ad, [a], [[Rewind(1), "something else entirely"]])
    assert _length(pool, a) < cut
    for st in (a, c):
        ad.begin_response(st, TEXT)
    for _ in range(6):
        out.step([a, c, d], set())
    for st in (a, c, d):
        ad.free(st)
    return out


def test_static_decode_steps_give_the_eager_replies(make):
    static, eager = make(True), make(False)
    said, expected = conversation(static), conversation(eager)
    assert said.said == expected.said
    assert all(r["ids"] for r in expected.said.values())
    assert expected.said["a"]["codes"] and expected.said["c"]["codes"]
    assert said.crossed
    assert (4, 3) in zip(said.widths[:-1], said.widths[1:], strict=True), said.widths
    # Every decode step of the static model ran from the buffers, none of the eager one's did.
    steps = static.graph_stats()
    for stage in ("thinker", "talker", "code_predictor"):
        assert steps[stage]["static"] > 0 and steps[stage]["eager"] == 0, (stage, steps)
        assert eager.graph_stats()[stage]["static"] == 0
    # Nothing is left but the prefix cache's system turn.
    assert static._pools.thinker.blocks_used * static._pools.thinker.block_bytes == \
        static.prefix_cache.stats().bytes
    assert static._pools.talker.blocks_used == 0
