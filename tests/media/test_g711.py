"""G.711 against FFmpeg's pcm_mulaw / pcm_alaw (through PyAV) as the oracle."""

import av
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.media import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

CODECS = [("pcm_mulaw", ulaw_encode, ulaw_decode), ("pcm_alaw", alaw_encode, alaw_decode)]


def av_encode(codec: str, pcm: np.ndarray) -> bytes:
    ctx = av.CodecContext.create(codec, "w")
    ctx.sample_rate, ctx.format, ctx.layout = 8000, "s16", "mono"
    frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = 8000
    return b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])


def av_decode(codec: str, data: bytes) -> np.ndarray:
    ctx = av.CodecContext.create(codec, "r")
    ctx.sample_rate, ctx.layout = 8000, "mono"
    return np.concatenate([f.to_ndarray().reshape(-1) for f in ctx.decode(av.Packet(data))])


@pytest.mark.parametrize("codec, encode, decode", CODECS)
def test_every_pcm16_value_encodes_as_ffmpeg_does(codec, encode, decode):
    pcm = np.arange(-32768, 32768, dtype=np.int16)
    assert encode(pcm) == av_encode(codec, pcm)


@pytest.mark.parametrize("codec, encode, decode", CODECS)
def test_every_code_decodes_as_ffmpeg_does(codec, encode, decode):
    codes = bytes(range(256))
    np.testing.assert_array_equal(decode(codes), av_decode(codec, codes))


@pytest.mark.parametrize("codec, encode, decode", CODECS)
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400))
def test_decode_then_encode_is_identity_on_codes(codec, encode, decode, data):
    roundtrip = encode(decode(data))
    # mu-law has two codes for zero (0x7F and 0xFF); both decode to 0.
    np.testing.assert_array_equal(decode(roundtrip), decode(data))


def test_encode_refuses_float_input():
    with pytest.raises(TypeError):
        ulaw_encode(np.zeros(4, dtype=np.float32))


@pytest.mark.parametrize("law", ["ulaw", "alaw"])
def test_float_round_trip_through_g711_stays_within_a_quantisation_step(law):
    from duplex.media import float_to_g711, g711_to_float

    x = np.sin(np.linspace(0, 20, 800)).astype(np.float32) * 0.5
    y = g711_to_float(float_to_g711(x, law), law)
    assert y.dtype == np.float32 and len(y) == len(x)
    # G.711's steps grow with amplitude; the largest is 1/32 of full scale, so no sample is
    # more than half of that away.
    assert np.max(np.abs(y - x)) <= 1 / 64
