"""`duplex bench --listener` on the echo model, briefly: every transport's peers talk over
replies, and what each heard is judged. Figures are the bench's business; here, that it
measures them and that a coughed-over reply came back whole."""

import numpy as np
import pytest

from duplex.bench.listener import COUGH_S, Barge, bench, cough, judge, table
from duplex.bench.peers import RealtimePeer
from duplex.bench.speech import utterances
from duplex.config import load_settings


def test_a_cough_is_150_ms_of_the_loudest_syllable_of_a_recording():
    burst = cough(24000)
    assert len(burst) == COUGH_S * 24000 and np.abs(burst).max() == pytest.approx(0.9)
    speech = utterances(24000)[2]
    # Taken from inside the recording, where it is loudest.
    assert np.sqrt(np.mean(burst**2)) > 2 * np.sqrt(np.mean(speech**2)) * 0.9 / np.abs(speech).max()


def test_a_barge_in_stops_where_playback_of_what_was_sent_before_the_pause_ended():
    peer = RealtimePeer.__new__(RealtimePeer)
    RealtimePeer.__base__.__init__(peer, 2.0)
    p = peer.playout
    p.push(0, np.ones(4800, np.float32), "r")      # 200 ms, sent at 0
    p.push(2400, np.ones(2400, np.float32), "r")   # 100 ms more, sent at 100 ms
    peer.pauses.append(3600)                       # paused 150 ms in
    p.clear(6000)                                  # flushed at speech_started, 250 ms in
    p.push(9600, np.ones(4800, np.float32), "r")   # a resumed reply, sent after the pause
    j = judge(peer, Barge("speech", 1200, "r"))
    assert (j["stop_ms"], j["pause_ms"], j["paused"]) == (200.0, 100.0, True)
    # Talked over where nothing of it played: no figure.
    assert judge(peer, Barge("speech", 8000, "r")) is None


@pytest.mark.timing
@pytest.mark.slow
def test_the_listener_bench_talks_over_replies_on_every_transport_and_judges_what_was_heard():
    settings = load_settings(None, cli={"engine": {"process": False}})
    report = bench("echo", settings, sessions=1, duration_s=7.0,
                   transports=("twilio", "webrtc", "websocket_paused"), log=lambda _: None)
    for name, m in report["transports"].items():
        assert m["barge_ins"] >= 1 and m["stop_ms"]["p50"] is not None, (name, m)
        # Whatever the timing, a coughed-over reply was heard whole, resumed or never paused.
        assert m["coughs"] >= 1 and m["coughs_heard_whole"] == m["coughs"], (name, m)
    webrtc = report["transports"]["webrtc"]
    # The peer's path to its loudspeaker holds the part up to aiortc's output, and more.
    assert webrtc["path_ms"]["n"] == webrtc["receive_ms"]["n"] > 0
    assert webrtc["path_ms"]["p50"] >= webrtc["receive_ms"]["p50"] - 1
    lines = table(report).splitlines()
    assert lines[0].split() == ["twilio", "webrtc", "websocket_paused"]
    assert any(line.startswith("  net of the peer's receive path") for line in lines)
