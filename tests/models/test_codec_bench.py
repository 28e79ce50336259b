"""The bench's codec measurement through each family's own `codec_decode` and offline decoder."""

import pytest

from duplex.bench import codec as codec_bench
from duplex.bench.codec import stream_vs_offline
from models.base import OfflineCodec
from models.echo import EchoModel
from models.moshi.adapter import MoshiAdapter
from models.qwen3_omni.adapter import Qwen3OmniAdapter

KEYS = {
    "n_frames",
    "sessions",
    "offline_ms_per_frame",
    "stream_ms_per_frame",
    "ratio",
    "max_abs_diff",
    "signal_rms",
    "diff_over_rms",
}


@pytest.fixture(params=["tiny-omni", "tiny-moshi"])
def adapter(request, tiny_omni_dir, tiny_moshi_dir):
    if request.param == "tiny-omni":
        return Qwen3OmniAdapter.from_pretrained(tiny_omni_dir)
    return MoshiAdapter.from_pretrained(tiny_moshi_dir)


def test_streaming_is_measured_against_offline_and_matches_it(adapter):
    report = stream_vs_offline(adapter, n_frames=3, repeats=1, batches=(1, 2))
    assert set(report) == {"batch_1", "batch_2"}
    for sessions, figures in zip((1, 2), report.values(), strict=True):
        assert set(figures) == KEYS
        assert (figures["n_frames"], figures["sessions"]) == (3, sessions)
        assert figures["signal_rms"] > 0.01
        assert figures["diff_over_rms"] <= 1e-4
        assert figures["offline_ms_per_frame"] > 0 and figures["stream_ms_per_frame"] > 0
        assert figures["ratio"] == pytest.approx(
            figures["stream_ms_per_frame"] / figures["offline_ms_per_frame"]
        )


def test_a_model_without_a_codec_has_no_measurement():
    assert stream_vs_offline(EchoModel()) is None


class ClockedCodec:
    """An offline codec whose decode takes `frame_s` per frame of a fake clock."""

    def __init__(self, frame_s: float) -> None:
        self.frame_s, self.now = frame_s, 0.0

    def clock(self) -> float:
        return self.now

    def decode(self, codes):
        self.now += self.frame_s * codes.shape[0] * codes.shape[2]
        return codes


@pytest.mark.parametrize(("frame_s", "frames"), [(0.001, 50), (0.01, 37), (0.3, 2)])
def test_the_codec_measurement_fits_its_time_budget(monkeypatch, frame_s, frames):
    codec = ClockedCodec(frame_s)
    monkeypatch.setattr(codec_bench.time, "perf_counter", codec.clock)
    offline = OfflineCodec(16, 2048, 0, codec.decode)
    # 3 repeats of 1 + 8 streams, each frame offline once and streamed at ~5x: 162 frame costs.
    assert codec_bench.affordable_frames(offline, 50, 27, budget_s=60.0) == frames
