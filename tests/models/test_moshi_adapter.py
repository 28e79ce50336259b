"""MoshiAdapter on a tiny random checkpoint: it matches transformers' Moshi, batches sessions of
different ages exactly as it runs each alone, round-trips through disk and frees what it holds."""

import numpy as np
import pytest
import torch
from torch import nn

from models.moshi.adapter import MoshiAdapter
from models.moshi.tiny import build_tiny, tiny_moshi_config

FRAME = 1920


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moshi")
    return path, build_tiny(path)


@pytest.fixture(scope="module")
def adapter(checkpoint):
    return MoshiAdapter.from_pretrained(checkpoint[0], min_response_frames=3, max_response_frames=6)


def chunks(seed, count):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(FRAME).astype(np.float32) for _ in range(count)]


def converse(adapter, states, heard, steps):
    """Hear `heard[i]` chunks per session (batched per chunk index), reply for `steps` steps."""
    for t in range(max(len(h) for h in heard)):
        rows = [i for i, h in enumerate(heard) if t < len(h)]
        picked = [states[i] for i in rows]
        features = adapter.encode_audio(picked, [heard[i][t] for i in rows])
        adapter.thinker_prefill(picked, features)
    for state in states:
        adapter.begin_response(state)
    texts, codes, pcm = [[] for _ in states], [[] for _ in states], [[] for _ in states]
    for _ in range(steps):
        tokens = adapter.thinker_decode(states)
        frames = adapter.talker_step(states, tokens)
        for i, (token, frame) in enumerate(zip(tokens, frames, strict=True)):
            texts[i].append(token.conditioning.text_id)
            if frame.codes is not None:
                codes[i].append(frame.codes)
        decodable = [i for i, frame in enumerate(frames) if frame.codes is not None]
        out = adapter.codec_decode(
            [states[i] for i in decodable], [frames[i].codes[:, None] for i in decodable]
        )
        for i, audio in zip(decodable, out, strict=True):
            pcm[i].append(audio)
    return texts, codes, [np.concatenate(p) for p in pcm]


def test_thinker_and_talker_match_transformers(adapter):
    model, q = adapter.model, adapter.num_codebooks
    state = adapter.new_state("s")
    features = [adapter.encode_audio([state], [c])[0] for c in chunks(0, 5)]
    adapter.thinker_prefill([state], [np.concatenate(features[:2], axis=1)])
    adapter.thinker_prefill([state], [np.concatenate(features[2:], axis=1)])
    adapter.begin_response(state)
    token = adapter.thinker_decode([state])[0]

    heard = torch.as_tensor(np.concatenate(features, axis=1))[None]
    user = torch.cat([heard, adapter.silence.view(1, q, 1)], dim=2)
    user[:, 1:] = torch.cat([torch.full((1, q - 1, 1), adapter.audio_none), user[:, 1:, :-1]], 2)
    text = torch.tensor([[adapter.text_pad] * 5 + [adapter.text_start]])
    moshi = torch.full((1, q, 6), adapter.audio_none)
    with torch.inference_mode():
        out = model(input_ids=text, user_audio_codes=user, moshi_audio_codes=moshi)
    assert torch.allclose(token.conditioning.hidden, out.last_hidden_state[0, -1], atol=1e-5)
    logits = out.logits[0, -1].clone()
    logits[adapter.eos_ids] = float("-inf")
    assert token.conditioning.text_id == logits.argmax().item()

    frame = adapter.talker_step([state], [token])[0]
    assert frame.codes is None
    generated = state.slots["turn"].moshi_in
    depth_ids = torch.cat([torch.tensor([token.conditioning.text_id]), generated[:-1]])[None]
    with torch.inference_mode():
        depth = model.depth_decoder(
            input_ids=depth_ids, last_hidden_state=token.conditioning.hidden[None, None]
        )
    assert torch.equal(depth.logits.argmax(-1)[0], generated)


def test_two_sessions_batched_equal_each_alone(adapter):
    heard = [chunks(1, 4), chunks(2, 2)]
    alone = [converse(adapter, [adapter.new_state(f"a{i}")], [heard[i]], 5) for i in range(2)]
    together = converse(adapter, [adapter.new_state("b0"), adapter.new_state("b1")], heard, 5)
    for i in range(2):
        assert together[0][i] == alone[i][0][0]
        assert np.array_equal(np.stack(together[1][i]), np.stack(alone[i][1][0]))
        assert np.allclose(together[2][i], alone[i][2][0], atol=1e-4)
        assert len(together[2][i]) == 4 * FRAME


def test_checkpoint_round_trips(checkpoint, adapter):
    in_memory = MoshiAdapter(checkpoint[1], min_response_frames=3, max_response_frames=6)
    heard = [chunks(3, 3)]
    saved = converse(in_memory, [in_memory.new_state("m")], heard, 4)
    loaded = converse(adapter, [adapter.new_state("l")], heard, 4)
    assert saved[0] == loaded[0]
    assert np.array_equal(np.stack(saved[1][0]), np.stack(loaded[1][0]))
    assert np.allclose(saved[2][0], loaded[2][0], atol=1e-5)
    config = tiny_moshi_config()
    assert adapter.detokenize(config.pad_token_id) == ""
    assert adapter.detokenize(config.vocab_size - 1).strip()


def test_response_ends_at_max_frames_and_not_before_min(adapter):
    state = adapter.new_state("s")
    adapter.thinker_prefill([state], adapter.encode_audio([state], chunks(4, 1)))
    adapter.begin_response(state)
    finished = []
    for _ in range(6):
        token = adapter.thinker_decode([state])[0]
        frame = adapter.talker_step([state], [token])[0]
        finished.append(frame.finished)
    assert finished == [False] * 5 + [True]
    with pytest.raises(RuntimeError):
        adapter.thinker_decode([state])


class AlwaysEos(nn.Module):
    def __init__(self, vocab_size, eos):
        super().__init__()
        self.vocab_size, self.eos = vocab_size, eos

    def forward(self, hidden):
        logits = hidden.new_zeros(*hidden.shape[:-1], self.vocab_size)
        logits[..., self.eos] = 1.0
        return logits


def test_text_eos_ends_response_after_min_frames(checkpoint):
    adapter = MoshiAdapter(checkpoint[1], min_response_frames=3, max_response_frames=50)
    config = tiny_moshi_config()
    original = adapter.model.decoder.lm_head
    adapter.model.decoder.lm_head = AlwaysEos(config.vocab_size, config.eos_token_id)
    try:
        state = adapter.new_state("s")
        adapter.begin_response(state)
        tokens = []
        for _ in range(3):
            tokens.append(adapter.thinker_decode([state])[0])
            adapter.talker_step([state], [tokens[-1]])
    finally:
        adapter.model.decoder.lm_head = original
    assert [t.finished for t in tokens] == [False, False, True]
    assert tokens[-1].conditioning.text_id == config.eos_token_id
    assert tokens[0].conditioning.text_id != config.eos_token_id


def test_bytes_held_returns_to_zero_after_free(adapter):
    state = adapter.new_state("s")
    assert adapter.bytes_held(state) >= 0
    converse(adapter, [state], [chunks(5, 3)], 3)
    held = adapter.bytes_held(state)
    assert held > 0
    adapter.reset_response(state)
    assert 0 < adapter.bytes_held(state) <= held
    adapter.free(state)
    assert adapter.bytes_held(state) == 0
