import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.media import (
    Framer,
    Resampler,
    float_to_pcm16,
    pcm16_to_float,
    resample,
)
from duplex.media.fir import FirResampler
from duplex.media.pcm import PcmError


def tone(rate: int, seconds: float = 0.5, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_pcm16_roundtrip_and_clipping():
    data = np.array([-32768, -1, 0, 1, 32767], dtype="<i2").tobytes()
    assert float_to_pcm16(pcm16_to_float(data)) == data
    clipped = np.frombuffer(float_to_pcm16(np.array([2.0, -2.0])), dtype="<i2")
    assert clipped.tolist() == [32767, -32768]


def test_odd_length_pcm16_is_an_error():
    with pytest.raises(PcmError, match="even number of bytes"):
        pcm16_to_float(b"\x00\x01\x02")


@pytest.mark.parametrize("src, dst", [(8000, 24000), (16000, 48000), (48000, 16000), (24000, 8000)])
def test_resample_keeps_duration_and_pitch(src, dst):
    out = resample(tone(src), src, dst)
    assert abs(len(out) - len(tone(dst))) <= 1
    spectrum = np.abs(np.fft.rfft(out))
    peak_hz = np.argmax(spectrum) * dst / len(out)
    assert abs(peak_hz - 440) < 5


def test_streaming_resampler_matches_total_length_and_content():
    signal = tone(48000, 1.0)
    stream = Resampler(48000, 16000)
    pieces = [stream.process(signal[i : i + 960]) for i in range(0, len(signal), 960)]
    pieces.append(stream.process(np.zeros(0, np.float32), last=True))
    out = np.concatenate(pieces)
    assert len(out) == 16000
    np.testing.assert_allclose(out[200:-200], resample(signal, 48000, 16000)[200:-200], atol=1e-3)


def test_unsupported_rate_is_refused():
    with pytest.raises(ValueError, match="unsupported sample rate 44100"):
        resample(tone(8000), 44100, 16000)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 700), max_size=30), st.integers(1, 500))
def test_framer_carries_the_remainder(sizes, frame):
    framer = Framer(frame)
    source = np.arange(sum(sizes), dtype=np.float32)
    out, pos = [], 0
    for n in sizes:
        out += framer.push(source[pos : pos + n])
        pos += n
    assert all(len(f) == frame for f in out)
    rest = framer.flush()
    assert len(rest) < frame
    np.testing.assert_array_equal(np.concatenate([*out, rest]) if out else rest, source)



def _chunks(signal, sizes):
    at = 0
    for n in sizes:
        yield signal[at:at + n]
        at += n
    yield signal[at:]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 6000), min_size=1, max_size=12),
       st.lists(st.integers(0, 1500), max_size=8),
       st.sampled_from([(24000, 16000), (24000, 8000), (24000, 24000), (24000, 48000),
                        (8000, 24000)]),
       st.integers(0, 2**32 - 1))
def test_a_resampler_resumed_from_its_state_goes_on_sample_for_sample(before, after, rates,
                                                                      seed):
    """The input path's resamplers after a resume on another node (the model's, and the
    G.711 upsampler, 8 -> 24 kHz): A then B through one resampler equals A through one, its
    state saved and restored, B through the new one, chunk for chunk (when a sample is
    released decides which turn a commit puts it in)."""
    src, rate = rates
    rng = np.random.default_rng(seed)
    a = rng.uniform(-0.5, 0.5, sum(before)).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, sum(after) + 100).astype(np.float32)
    whole = FirResampler(src, rate)
    expected = [whole.process(c) for c in [*_chunks(a, before), *_chunks(b, after)]]
    first = FirResampler(src, rate)
    heard = [first.process(c) for c in _chunks(a, before)]
    resumed = FirResampler.resume(src, rate, first.state())
    heard += [resumed.process(c) for c in _chunks(b, after)]
    assert [len(c) for c in heard] == [len(c) for c in expected]
    assert np.array_equal(np.concatenate(heard), np.concatenate(expected))
    assert whole.emitted == len(np.concatenate(expected))
    # Everything fed is given but the few samples still waiting for their filter's centre.
    assert 0 <= -(-whole.fed * rate // src) - whole.emitted <= whole.lookahead


@pytest.mark.parametrize("rate", [16000, 8000, 48000])
def test_the_resumable_resampler_passes_speech_and_stops_aliases(rate):
    t = np.arange(24000) / 24000
    def level(freq):
        out = FirResampler(24000, rate).process(np.sin(2 * np.pi * freq * t).astype(np.float32))
        return 20 * np.log10(np.abs(out[len(out) // 4:-len(out) // 4]).max())
    nyquist = min(rate, 24000) // 2
    assert level(1000) > -0.1
    assert level(nyquist * 0.85) > -1.0
    if rate < 24000:
        assert level(nyquist * 1.1) < -60


@pytest.mark.parametrize("src, rate", [(24000, 8000), (24000, 16000), (24000, 48000),
                                       (8000, 24000)])
def test_the_resumable_resampler_adds_no_delay(src, rate):
    # An impulse comes out where it went in, on the other rate's clock: the session timeline
    # does not move by the filter's length.
    x = np.zeros(2400, np.float32)
    x[1200] = 1.0
    r = FirResampler(src, rate)
    out = np.concatenate([r.process(x), r.process(np.zeros(480, np.float32))])
    assert abs(int(np.argmax(out)) - 1200 * rate // src) <= 1


def test_the_g711_upsampler_passes_the_telephone_band_and_stops_its_images():
    # 8 -> 24 kHz: a tone at f comes out at f, and nothing of it at 8 kHz - f or 8 kHz + f.
    t = np.arange(8000) / 8000
    for freq in (300, 1000, 3400):
        out = FirResampler(8000, 24000).process(np.sin(2 * np.pi * freq * t).astype(np.float32))
        mid = out[len(out) // 4:-len(out) // 4]
        spectrum = np.abs(np.fft.rfft(mid * np.hanning(len(mid))))
        at = spectrum[np.rint(np.array([freq, 8000 - freq, 8000 + freq]) * len(mid) / 24000)
                      .astype(int)]
        assert 20 * np.log10(at[0] / (len(mid) / 4)) > -1.0
        assert 20 * np.log10(at[1:].max() / at[0]) < -60
