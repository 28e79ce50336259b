import math

import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from models.qwen3_omni.codec import (
    Code2WavPool,
    StreamingCode2Wav,
    offline_decode,
    tiny_code2wav_config,
)


@pytest.fixture(scope="module")
def module() -> Qwen3OmniMoeCode2Wav:
    """A tiny Code2Wav whose random weights give a signal of RMS ~0.2 rather than ~1e-7.

    The default init (std 0.02, layer scales 0.01, ConvNeXt gamma 1e-6) all but silences the
    output, so a relative tolerance would test nothing; at much larger gains it clips.
    """
    torch.manual_seed(0)
    code2wav = Qwen3OmniMoeCode2Wav(tiny_code2wav_config()).eval()
    with torch.no_grad():
        for sub in code2wav.modules():
            if isinstance(sub, torch.nn.Conv1d | torch.nn.Linear):
                sub.weight.normal_(0, 0.7 / math.sqrt(sub.weight[0].numel()))
            elif isinstance(sub, torch.nn.ConvTranspose1d):
                sub.weight.normal_(0, 0.7 / math.sqrt(2 * sub.weight.shape[0]))
        for name, param in code2wav.named_parameters():
            if name.endswith(("gamma", ".scale")):
                param.fill_(0.5)
    return code2wav


def random_codes(module: Qwen3OmniMoeCode2Wav, batch: int, frames: int, seed: int) -> torch.Tensor:
    config = module.config
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, config.num_quantizers, frames)
    return torch.randint(0, config.codebook_size, shape, generator=generator)


def stream_chunks(stream, codes, state, sizes) -> torch.Tensor:
    pcm, start = [], 0
    for size in sizes:
        out = stream.decode(codes[:, :, start : start + size], state)
        assert out.shape == (codes.shape[0], size * stream.frame_samples)
        pcm.append(out)
        start += size
    assert start == codes.shape[-1]
    return torch.cat(pcm, dim=-1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 summation order: max abs diff <= 1e-4 * RMS of the signal."""
    assert actual.shape == expected.shape
    rms = expected.pow(2).mean().sqrt().item()
    assert rms > 0.01
    diff = (actual - expected).abs().max().item()
    assert diff <= 1e-4 * rms, (diff, rms)


def assert_matches_offline(stream, module, codes, pcm) -> None:
    """Streamed PCM is the offline signal behind `delay_samples` zeros."""
    assert torch.all(pcm[:, : stream.delay_samples] == 0)
    assert_close(pcm[:, stream.delay_samples :], offline_decode(module, codes))


def test_tiny_config_keeps_real_rates(module):
    stream = StreamingCode2Wav(module)
    assert stream.frame_samples == 1920
    assert stream.delay_samples == 555
    frames = 3
    assert offline_decode(module, random_codes(module, 1, frames, 0)).shape[-1] == (
        frames * stream.frame_samples - stream.delay_samples
    )


def test_frame_by_frame_matches_offline(module):
    stream = StreamingCode2Wav(module)
    codes = random_codes(module, 2, 14, seed=1)
    pcm = stream_chunks(stream, codes, stream.new_state(2), [1] * 14)
    assert_matches_offline(stream, module, codes, pcm)


def test_uneven_chunks_match_offline(module):
    stream = StreamingCode2Wav(module)
    # 9 > sliding_window: one call's queries span more than the cached window.
    sizes = [3, 1, 9, 2, 1, 5]
    codes = random_codes(module, 2, sum(sizes), seed=2)
    pcm = stream_chunks(stream, codes, stream.new_state(2), sizes)
    assert_matches_offline(stream, module, codes, pcm)


def test_two_slots_in_one_call_equal_each_alone(module):
    stream = StreamingCode2Wav(module)
    codes = random_codes(module, 2, 10, seed=3)
    together = stream_chunks(stream, codes, stream.new_state(2), [1] * 10)
    for slot in range(2):
        alone = stream_chunks(stream, codes[slot : slot + 1], stream.new_state(1), [1] * 10)
        assert_close(together[slot : slot + 1], alone)


def test_reset_one_slot_leaves_the_other(module):
    stream = StreamingCode2Wav(module)
    first = random_codes(module, 2, 6, seed=4)
    second = random_codes(module, 2, 7, seed=5)
    state = stream.new_state(2)
    head = stream_chunks(stream, first, state, [1] * 6)
    state.reset([1])
    assert state.frames.tolist() == [6, 0]
    # Slot 0 continues at frame 6 while slot 1 restarts at 0, in the same calls.
    tail = stream_chunks(stream, second, state, [2, 1, 4])

    kept = torch.cat([first[:1], second[:1]], dim=-1)
    assert_matches_offline(stream, module, kept, torch.cat([head[:1], tail[:1]], dim=-1))
    assert_matches_offline(stream, module, second[1:], tail[1:])


def test_slot_subsets_and_per_session_states(module):
    stream = StreamingCode2Wav(module)
    codes = random_codes(module, 3, 5, seed=6)
    expected = stream_chunks(stream, codes, stream.new_state(3), [1] * 5)

    # A pool whose slots come in a different order each time; at frame 2, slot 1 comes alone.
    pool = stream.new_state(3)
    pcm = torch.zeros_like(expected)
    schedule = [[[2, 0, 1]], [[1, 2, 0]], [[0, 2], [1]], [[2, 1, 0]], [[0, 1, 2]]]
    span = stream.frame_samples
    for t, calls in enumerate(schedule):
        for order in calls:
            out = stream.decode(codes[order, :, t : t + 1], pool, slots=order)
            pcm[order, t * span : (t + 1) * span] = out
    assert_close(pcm, expected)
    assert pool.frames.tolist() == [5, 5, 5]



def test_pool_rows_follow_their_sessions_and_a_reused_row_starts_fresh(module):
    stream = StreamingCode2Wav(module)
    codes = random_codes(module, 3, 5, seed=8)
    expected = stream_chunks(stream, codes, stream.new_state(3), [1] * 5)
    span = stream.frame_samples
    pool = Code2WavPool(stream)
    rows = {sid: pool.acquire(sid) for sid in "abc"}
    done = dict.fromkeys("abc", 0)
    # Sessions come in a different order and a different company at each call.
    for group in ["abc", "cb", "a", "bca", "ac", "ba", "c"]:
        pick = ["abc".index(sid) for sid in group]
        frame = [done[sid] for sid in group]
        batch = torch.stack([codes[i, :, f : f + 1] for i, f in zip(pick, frame, strict=True)])
        out = pool.decode(batch, [rows[sid] for sid in group], list(group))
        for j, (i, f) in enumerate(zip(pick, frame, strict=True)):
            assert_close(out[j : j + 1], expected[i : i + 1, f * span : (f + 1) * span])
        for sid in group:
            done[sid] += 1
    assert done == {"a": 5, "b": 4, "c": 5}
    with pytest.raises(ValueError, match="belongs to 'b'"):
        pool.decode(codes[:1, :, :1], [rows["b"]], ["a"])
    pool.release(rows["b"], "b")
    again = pool.acquire("d")
    assert again == rows["b"]
    fresh = pool.decode(codes[:1, :, :1], [again], ["d"])
    assert_close(fresh, expected[:1, :span])
    for sid in "acd":
        pool.release(rows.get(sid, again), sid)
    assert pool.state is None and pool.row_bytes() == 0


def test_state_bytes_do_not_grow_with_frames(module):
    stream = StreamingCode2Wav(module)
    one, two = stream.new_state(1), stream.new_state(2)
    assert one.nbytes > 0
    assert two.nbytes == 2 * one.nbytes
    stream.decode(random_codes(module, 2, 3, seed=7), two)
    assert two.nbytes == 2 * one.nbytes
