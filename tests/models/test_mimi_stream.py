"""Streaming Mimi equals offline Mimi: frame by frame, batched across sessions of different ages."""

import pytest
import torch

from models.moshi.mimi_stream import MimiStreamDecoder, MimiStreamEncoder
from models.moshi.tiny import tiny_mimi

FRAME = 1920
# A window of 6 positions (3 frames) makes 30 frames slide it, and drop old KV, many times.
WINDOW = 6


@pytest.fixture(scope="module")
def mimi():
    return tiny_mimi(sliding_window=WINDOW)


def random_codes(mimi, sessions, frames, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (sessions, mimi.config.num_quantizers, frames)
    return torch.randint(0, mimi.config.codebook_size, shape, generator=generator)


def offline(mimi, codes):
    with torch.inference_mode():
        return mimi.decode(codes).audio_values


def assert_close_to(streamed, reference):
    rms = reference.pow(2).mean().sqrt()
    assert streamed.shape == reference.shape
    assert (streamed - reference).abs().max() <= 1e-4 * rms


def test_frame_by_frame_decode_equals_offline(mimi):
    codes = random_codes(mimi, 1, 30)
    decoder = MimiStreamDecoder(mimi)
    state = decoder.new_state()
    chunks = [decoder.decode([state], codes[:, :, t : t + 1]) for t in range(30)]
    assert all(chunk.shape[-1] == FRAME for chunk in chunks)
    assert_close_to(torch.cat(chunks, dim=-1), offline(mimi, codes))
    assert state.kv.capacity < 4 * WINDOW


def test_chunks_of_several_frames_equal_offline(mimi):
    codes = random_codes(mimi, 1, 12, seed=1)
    decoder = MimiStreamDecoder(mimi)
    state = decoder.new_state()
    chunks = [decoder.decode([state], codes[:, :, t : t + 3]) for t in range(0, 12, 3)]
    assert_close_to(torch.cat(chunks, dim=-1), offline(mimi, codes))


def test_batched_decode_equals_each_session_alone(mimi):
    codes = random_codes(mimi, 2, 16, seed=2)
    decoder = MimiStreamDecoder(mimi)
    old, new = decoder.new_state(), decoder.new_state()
    head = [decoder.decode([old], codes[:1, :, t : t + 1]) for t in range(5)]
    tail = [decoder.decode([old, new], codes[:, :, t : t + 1]) for t in range(5, 16)]
    first = torch.cat(head + [chunk[:1] for chunk in tail], dim=-1)
    second = torch.cat([chunk[1:] for chunk in tail], dim=-1)
    assert_close_to(first, offline(mimi, codes[:1]))
    assert_close_to(second, offline(mimi, codes[1:, :, 5:]))


def test_stream_encode_equals_offline(mimi):
    audio = torch.randn(2, 1, 10 * FRAME, generator=torch.Generator().manual_seed(3))
    encoder = MimiStreamEncoder(mimi)
    old, new = encoder.new_state(), encoder.new_state()
    head = [encoder.encode([old], audio[:1, :, : 2 * FRAME])]
    tail = [
        encoder.encode([old, new], audio[:, :, t * FRAME : (t + 1) * FRAME]) for t in range(2, 10)
    ]
    with torch.inference_mode():
        reference_old = mimi.encode(audio[:1]).audio_codes
        reference_new = mimi.encode(audio[1:, :, 2 * FRAME :]).audio_codes
    assert torch.equal(torch.cat(head + [codes[:1] for codes in tail], dim=-1), reference_old)
    assert torch.equal(torch.cat([codes[1:] for codes in tail], dim=-1), reference_new)


def test_encode_rejects_partial_frames(mimi):
    encoder = MimiStreamEncoder(mimi)
    with pytest.raises(ValueError):
        encoder.encode([encoder.new_state()], torch.zeros(1, 1, FRAME + 1))


def test_state_bytes_and_release(mimi):
    decoder, encoder = MimiStreamDecoder(mimi), MimiStreamEncoder(mimi)
    decode_state, encode_state = decoder.new_state(), encoder.new_state()
    decoder.decode([decode_state], random_codes(mimi, 1, 2))
    encoder.encode([encode_state], torch.zeros(1, 1, FRAME))
    assert decode_state.nbytes > 0 and encode_state.nbytes > 0
    decode_state.release()
    encode_state.release()
    assert decode_state.nbytes == 0 and encode_state.nbytes == 0
