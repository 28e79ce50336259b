"""The engine loop with the echo model: exact output, shared batches, cancel, close; each on a
thread of this process and in an engine process of its own."""

import threading
import time

import numpy as np
import pytest

from duplex.engine import (
    AdmissionRefused,
    AudioOut,
    ChildSpec,
    Engine,
    EngineConfig,
    EngineProcess,
    ResponseFinished,
    SchedulerConfig,
)
from duplex.engine.client import admit
from models.echo import EchoModel
from models.reply import ReplySpec
from tests.waiting import until


class Collector:
    def __init__(self):
        self.events = []
        self.finished = threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, ResponseFinished):
            self.finished.set()

    def audio(self, epoch=None):
        chunks = [e.pcm for e in self.events if isinstance(e, AudioOut) and epoch in (None, e.epoch)]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)


def start(kind: str, config: EngineConfig):
    if kind == "thread":
        eng = Engine(EchoModel(), config)
    else:
        eng = EngineProcess(ChildSpec("echo", ".models", "cpu", config, torch_threads=1))
    eng.start()
    return eng


@pytest.fixture(params=["thread", "process"])
def kind(request):
    return request.param


@pytest.fixture
def engine(kind):
    eng = start(kind, EngineConfig(max_sessions=8))
    yield eng
    eng.stop()


def speak(eng, sid, signal, step=480):
    for i in range(0, len(signal), step):
        eng.push_audio(sid, signal[i : i + step])


def test_echo_returns_the_committed_audio_exactly(engine):
    got = Collector()
    engine.open("a", got)
    signal = np.random.default_rng(1).uniform(-0.5, 0.5, 30_001).astype(np.float32)
    speak(engine, "a", signal)
    engine.commit("a", 0)
    assert got.finished.wait(5)
    np.testing.assert_array_equal(got.audio(), signal)
    assert got.events[-1] == ResponseFinished("a", 0, 30_001)


def test_two_sessions_share_one_forward_and_never_mix(engine):
    got = {sid: Collector() for sid in "ab"}
    signals = {
        sid: np.full(19_200, value, np.float32) for sid, value in (("a", 0.25), ("b", -0.5))
    }
    for sid in "ab":
        engine.open(sid, got[sid])
    engine.wait_idle()
    for sid in "ab":
        speak(engine, sid, signals[sid], step=19_200)
        engine.commit(sid, 0)
    for sid in "ab":
        assert got[sid].finished.wait(5)
        np.testing.assert_array_equal(got[sid].audio(), signals[sid])
    engine.wait_idle()
    assert max(engine.stats.stages["codec"].batch_sizes) == 2
    assert max(engine.stats.stages["talker"].batch_sizes) == 2


def test_baseline_mode_makes_one_call_per_session(kind):
    eng = start(kind, EngineConfig(batching=False))
    try:
        got = {sid: Collector() for sid in "ab"}
        for sid in "ab":
            eng.open(sid, got[sid])
        eng.wait_idle()
        for sid in "ab":
            speak(eng, sid, np.ones(9600, np.float32), step=9600)
            eng.commit(sid, 0)
        for sid in "ab":
            assert got[sid].finished.wait(5)
        eng.wait_idle()
        assert set(eng.stats.stages["codec"].batch_sizes) == {1}
    finally:
        eng.stop()


def test_cancel_drops_the_old_epoch_and_frees_its_bytes(kind):
    # A slow audio lead keeps most of the reply queued inside the engine when the cancel lands.
    eng = start(kind, EngineConfig(scheduler=SchedulerConfig(audio_lead_s=0.2)))
    try:
        got = Collector()
        eng.open("a", got)
        speak(eng, "a", np.ones(24_000 * 3, np.float32), step=24_000)
        eng.commit("a", 0)
        until(lambda: got.events, "the reply's first audio", 5)
        held_during = eng.bytes_held("a")
        eng.cancel("a", 1)
        eng.wait_idle()
        held_after = eng.bytes_held("a")
        reasons = {d.reason for d in eng.drain_drops()}
        sent_before = len(got.audio())
        # The next turn, in the new epoch, works as usual; it goes through the same queues, so
        # once it has finished any audio of the old epoch still on its way would have come out.
        speak(eng, "a", np.full(4800, 0.5, np.float32))
        eng.commit("a", 1)
        assert got.finished.wait(5)
        np.testing.assert_array_equal(got.audio(epoch=1), np.full(4800, 0.5, np.float32))
        assert len(got.audio(epoch=0)) == sent_before < 24_000 * 3
        assert {e.epoch for e in got.events if isinstance(e, ResponseFinished)} == {1}
        assert held_during > 0 and held_after == 0
        assert reasons <= {"stale_epoch"}
    finally:
        eng.stop()


def test_close_releases_everything(engine):
    got = Collector()
    engine.open("a", got)
    speak(engine, "a", np.ones(48_000, np.float32))
    engine.wait_idle()
    assert engine.bytes_held("a") > 0
    engine.close("a")
    engine.wait_idle()
    assert engine.bytes_held("a") == 0
    assert engine.total_bytes_held() == 0
    # Nothing of the old session is left to collide with: the same id starts afresh.
    again = Collector()
    engine.open("a", again)
    speak(engine, "a", np.full(4800, 0.5, np.float32))
    engine.commit("a", 0)
    assert again.finished.wait(5)
    np.testing.assert_array_equal(again.audio(), np.full(4800, 0.5, np.float32))


def test_admission_refuses_past_max_sessions_naming_the_limit(engine):
    for i in range(8):
        engine.open(f"s{i}", Collector())
    with pytest.raises(AdmissionRefused, match=r"engine.max_sessions=8") as info:
        engine.open("one-too-many", Collector())
    assert info.value.limit == "engine.max_sessions"


def test_admission_refuses_when_load_would_pass_real_time():
    # Both engines admit through this one rule, against the load their core last reported.
    config = EngineConfig(max_sessions=8)
    admit(1, 0.4, config)
    with pytest.raises(AdmissionRefused, match=r"engine.max_load=85%") as info:
        admit(1, 0.6, config)
    assert info.value.limit == "engine.max_load"


def test_a_payload_of_another_dtype_fails_its_session_instead_of_computing():
    from duplex.engine import SessionFailed
    from duplex.engine import messages as m
    from duplex.engine.core import EngineCore

    failed = []
    done = threading.Event()

    def emit(output):
        if isinstance(output, SessionFailed):
            failed.append(output)
            done.set()

    core = EngineCore(EchoModel(), EngineConfig(max_sessions=2), emit)
    core.start()
    try:
        core.submit(m.OpenSession("ints"))
        core.submit(m.PushAudio("ints", np.zeros(EchoModel().input_chunk_samples, np.int16)))
        core.submit(m.Commit("ints", 0, time.monotonic(), ReplySpec()))
        assert done.wait(5)
        assert failed[0].session_id == "ints" and "int16, not float32" in failed[0].message
    finally:
        core.stop()


def test_a_payload_of_another_model_version_is_refused_at_its_stage():
    from duplex.engine import messages as m
    from duplex.engine.core import EngineCore, PayloadMismatch

    core = EngineCore(EchoModel(), EngineConfig(max_sessions=2), lambda output: None)
    core.submit(m.OpenSession("old"))
    core._apply_requests(block_s=0)  # stepped here, not on a thread: the test owns the core
    now = time.monotonic()
    core.scheduler.push_input("old", np.zeros(EchoModel().input_chunk_samples, np.float32),
                              now, "an-older-echo")
    core.scheduler.commit("old", 0, now)
    with pytest.raises(PayloadMismatch, match="of model 'an-older-echo'"):
        core._step(core.scheduler.schedule(now), now)
