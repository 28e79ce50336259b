"""Qwen3-Omni adapter on the tiny random-weight checkpoint: exactness of batching and KV slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from models.base import ModelState, TextTurn
from models.qwen3_omni.adapter import (
    STATE_KEY,
    Qwen3OmniAdapter,
    Qwen3OmniOptions,
    Sampling,
    SlotOwnershipError,
)
from models.qwen3_omni.tiny import load, load_preprocessor, tiny_model

pytestmark = pytest.mark.cpu_bound

OPTIONS = Qwen3OmniOptions(min_text_tokens=4, max_text_tokens=8, min_frames=6, max_frames=10)


@pytest.fixture(scope="module")
def checkpoint(tiny_omni_dir):
    return tiny_omni_dir


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return Qwen3OmniAdapter.from_pretrained(checkpoint, options=OPTIONS)


@pytest.fixture(scope="module")
def make(checkpoint, loaded):
    """Fresh adapters (empty slot pools) sharing the loaded weights."""
    prep = load_preprocessor(checkpoint, loaded.model.config)

    def build(options: Qwen3OmniOptions = OPTIONS, model=None) -> Qwen3OmniAdapter:
        return Qwen3OmniAdapter(model or loaded.model, loaded.tokenizer, prep, options=options)

    return build


def audio(seed: int, seconds: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)


def frame(seed: int, height: int = 64, width: int = 96) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def user_turn(ad: Qwen3OmniAdapter, states: list[ModelState], scripts: list[list]) -> None:
    """scripts[i] lists session i's inputs (text, 1-D audio, H*W*3 frame); step k prefills
    everyone's k-th input in one call, after one batched encode per modality."""
    for k in range(max(len(s) for s in scripts)):
        items = [s[k] if k < len(s) else None for s in scripts]
        payloads = [TextTurn(x) if isinstance(x, str) else x for x in items]
        for ndim, encode in ((1, ad.encode_audio), (3, ad.encode_video)):
            idx = [i for i, x in enumerate(items) if isinstance(x, np.ndarray) and x.ndim == ndim]
            if idx:
                feats = encode([states[i] for i in idx], [items[i] for i in idx])
                for i, feat in zip(idx, feats, strict=True):
                    payloads[i] = feat
        ad.thinker_prefill(states, payloads)


def respond(ad: Qwen3OmniAdapter, states: list[ModelState], steps: int, swap: bool = False):
    """Run a reply for every state in lockstep; `swap` reverses the batch order on odd steps."""
    for st in states:
        ad.begin_response(st)
    texts = {st.session_id: [] for st in states}
    codes = {st.session_id: [] for st in states}
    pcm = {st.session_id: [] for st in states}
    for step in range(steps):
        batch = states[::-1] if swap and step % 2 else states
        tokens = ad.thinker_decode(batch)
        frames = ad.talker_step(batch, tokens)
        voiced = [(st, f.codes) for st, f in zip(batch, frames, strict=True) if f.codes is not None]
        for st, tok in zip(batch, tokens, strict=True):
            if tok.conditioning is not None:
                texts[st.session_id].append(ad._session(st).last_token)
        if voiced:
            sts, cs = zip(*voiced, strict=True)
            for st, c, wav in zip(sts, cs, ad.codec_decode(list(sts), list(cs)), strict=True):
                codes[st.session_id].append(c.tolist())
                pcm[st.session_id].append(wav)
    return texts, codes, {k: np.concatenate(v) if v else v for k, v in pcm.items()}


SCRIPTS = {
    "a": ["hi", audio(1), frame(5, 32, 64), audio(2)],
    "b": ["a longer opening line", audio(4), frame(3), "and more text"],
}


def slot_keys(pool, layer: int, slot: int, n: int) -> torch.Tensor:
    """The keys of a slot's first `n` positions in one layer, (kv_heads, n, head_dim)."""
    return pool.keys[layer][:, torch.from_numpy(pool.addresses(slot, 0, n))]


def test_tiny_checkpoint_round_trips(checkpoint, loaded, make):
    assert Qwen3OmniAdapter.from_pretrained(checkpoint).options.min_frames > 1
    fresh = tiny_model()
    params = dict(fresh.named_parameters())
    assert 0.5e6 < sum(p.numel() for p in params.values()) < 2e6
    for name, p in load(checkpoint).named_parameters():
        assert torch.equal(p, params[name]), name
    outputs = []
    for model in (fresh, loaded.model):
        ad = make(model=model)
        st = ad.new_state("s")
        user_turn(ad, [st], [SCRIPTS["a"]])
        outputs.append(respond(ad, [st], 12))
    assert outputs[0][0] == outputs[1][0] and outputs[0][1] == outputs[1][1]
    np.testing.assert_array_equal(outputs[0][2]["s"], outputs[1][2]["s"])


def test_matches_generate_greedy(make):
    """The streaming Thinker, Talker and code predictor path is generate()'s, step by step."""
    greedy = Qwen3OmniOptions(
        min_text_tokens=3,
        max_text_tokens=6,
        min_frames=5,
        max_frames=5,
        talker_sampling=Sampling(),
        residual_sampling=Sampling(),
    )
    ad = make(greedy)
    st = ad.new_state("g")
    ad.thinker_prefill([st], [TextTurn("hello there")])
    texts, codes, _ = respond(ad, [st], 12)

    model, tok = ad.model, ad.tokenizer
    prompt = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    captured = {}
    talker_generate = model.talker.generate

    def keep(*args, **kwargs):
        captured["talker"] = talker_generate(*args, **kwargs)
        return captured["talker"]

    model.talker.generate = keep
    try:
        sequences, _ = model.generate(
            ids,
            speaker="ethan",
            thinker_max_new_tokens=6,
            thinker_min_new_tokens=3,
            thinker_do_sample=False,
            thinker_eos_token_id=ad._thinker.eos_ids,
            thinker_suppress_tokens=ad._thinker.suppress.nonzero().flatten().tolist(),
            talker_do_sample=False,
            # generate() only completes a frame's residual codes on the step after it.
            talker_max_new_tokens=6,
            talker_min_new_tokens=6,
            talker_repetition_penalty=1.0,
            return_audio=True,
        )
    finally:
        del model.talker.generate
    hidden = captured["talker"].hidden_states
    ref_codes = torch.stack([h[-1] for h in hidden if h[-1] is not None], dim=1)[0]
    assert texts["g"] == sequences[0, ids.shape[1] :].tolist()
    assert codes["g"] == ref_codes.tolist()


def test_batched_sessions_equal_solo(make):
    """Different context lengths, audio and video, sampled Talker: batching changes nothing."""
    ad = make()
    states = [ad.new_state(sid) for sid in SCRIPTS]
    user_turn(ad, states, list(SCRIPTS.values()))
    lengths = [ad._pools.thinker.length[ad._session(s).thinker_slot] for s in states]
    assert lengths[0] != lengths[1]
    batched = respond(ad, states, 14, swap=True)

    for sid, script in SCRIPTS.items():
        solo_ad = make()
        st = solo_ad.new_state(sid)
        user_turn(solo_ad, [st], [script])
        solo = respond(solo_ad, [st], 14)
        assert batched[0][sid] == solo[0][sid]
        assert batched[1][sid] == solo[1][sid]
        assert len(solo[1][sid]) >= OPTIONS.min_frames
        assert np.sqrt(np.mean(solo[2][sid] ** 2)) > 0.01
        np.testing.assert_allclose(batched[2][sid], solo[2][sid], atol=1e-5)


def test_chunked_thinker_equals_one_pass(make):
    ad = make()
    fed, lasts = [], []
    forward = ad._thinker.forward

    def record(sessions, step=False):
        fed.extend(sessions[0].pending)
        lasts.append(forward(sessions, step))
        return lasts[-1]

    ad._thinker.forward = record
    st = ad.new_state("c")
    user_turn(ad, [st], [SCRIPTS["b"]])
    ad.begin_response(st)
    ad.thinker_decode([st])
    assert len(lasts) == len(SCRIPTS["b"]) + 1

    embeds = torch.cat([p.embeds for p in fed])[None]
    positions = torch.from_numpy(np.concatenate([p.positions for p in fed], axis=1))[:, None]
    visual = torch.cat([torch.full((p.embeds.shape[0],), p.deepstack is not None) for p in fed])
    deep = [
        torch.cat(layer) for layer in zip(*(p.deepstack for p in fed if p.deepstack), strict=True)
    ]
    cache = DynamicCache(config=ad._thinker.lm.config)
    with torch.inference_mode():
        full = ad._thinker.lm(
            inputs_embeds=embeds,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            visual_pos_masks=visual[None],
            deepstack_visual_embeds=deep,
        )
    torch.testing.assert_close(lasts[-1][0], full.last_hidden_state[0, -1], atol=1e-5, rtol=1e-5)
    slot, n = ad._session(st).thinker_slot, embeds.shape[1]
    for layer in range(ad._thinker.lm.config.num_hidden_layers):
        torch.testing.assert_close(
            slot_keys(ad._pools.thinker, layer, slot, n),
            cache.layers[layer].keys[0],
            atol=1e-5,
            rtol=1e-5,
        )


def test_bytes_held_returns_to_zero(make):
    ad = make()
    states = [ad.new_state(sid) for sid in SCRIPTS]
    user_turn(ad, states, list(SCRIPTS.values()))
    respond(ad, states, 6)
    held = [ad.bytes_held(s) for s in states]
    assert all(h > 0 for h in held)
    ad.reset_response(states[0])
    assert 0 < ad.bytes_held(states[0]) < held[0]
    ad.free(states[0])
    assert ad.bytes_held(states[0]) == 0
    assert ad.bytes_held(states[1]) > 0
    ad.free(states[1])
    assert ad.bytes_held(states[1]) == 0
    assert ad._pools.thinker.blocks_used == 0 and ad._pools.talker.blocks_used == 0


def test_reused_slot_starts_clean_and_checks_its_owner(make):
    ad = make()
    old, keeper = ad.new_state("old"), ad.new_state("keeper")
    user_turn(ad, [old, keeper], [SCRIPTS["b"], SCRIPTS["a"]])
    respond(ad, [old, keeper], 4)
    stale = old.slots[STATE_KEY]
    slot = stale.thinker_slot
    pool = ad._pools.thinker
    old_blocks = set(pool.rows[slot])
    ad.free(old)
    # The blocks still hold the old session's keys; the new owner must never see them.
    assert all(pool.keys[0][:, b * pool.block_size].abs().sum() > 0 for b in old_blocks)

    new = ad.new_state("new")
    user_turn(ad, [new, keeper], [SCRIPTS["a"], ["go on"]])
    assert ad._session(new).thinker_slot == slot
    assert old_blocks & set(pool.rows[slot])
    # Batched with the longer keeper, the new row's reads reach past its own length.
    reused = respond(ad, [new, keeper], 12)

    clean_ad = make()
    clean = clean_ad.new_state("new")
    user_turn(clean_ad, [clean], [SCRIPTS["a"]])
    clean_out = respond(clean_ad, [clean], 12)
    assert reused[0]["new"] == clean_out[0]["new"] and reused[1]["new"] == clean_out[1]["new"]

    with pytest.raises(ValueError):
        ad.thinker_decode([old])
    stale.thinker_slot = slot
    with pytest.raises(SlotOwnershipError):
        ad.thinker_prefill([ModelState("old", {STATE_KEY: stale})], [TextTurn("leak?")])
    with pytest.raises(SlotOwnershipError):
        ad.thinker_prefill([ModelState("new", {STATE_KEY: stale})], [TextTurn("leak?")])


def test_long_session_slides_its_context(make):
    ad = make(Qwen3OmniOptions(max_context=64, system_prompt="be brief"))
    st = ad.new_state("long")
    sess = ad._session(st)
    user_turn(ad, [st], [["x" * 20] * 12])
    length = ad._pools.thinker.length[sess.thinker_slot]
    assert length <= 64 and sess.next_pos > 200
    keep = slot_keys(ad._pools.thinker, 0, sess.thinker_slot, sess.keep)
    user_turn(ad, [st], [["y" * 30] * 3])
    torch.testing.assert_close(slot_keys(ad._pools.thinker, 0, sess.thinker_slot, sess.keep), keep)
    assert respond(ad, [st], 3)[0]["long"]
