"""Native full-duplex sessions in the engine: each tick steps every due session one frame in one
batched model step; output frames sit on the timeline at input + the model's delay; a cancel
fences output but the model keeps listening; an engine that falls behind drops and resyncs
instead of letting latency grow, and admission refuses what would not fit the frame budget."""

import threading
import time

import numpy as np
import pytest

from duplex.engine import AdmissionRefused, Engine, EngineConfig
from duplex.engine.lockstep import DuplexDropped, DuplexOut
from models.echo import FRAME, EchoModel
from tests.waiting import until


class Collector:
    def __init__(self):
        self.events = []

    def __call__(self, event):
        self.events.append(event)

    def out(self):
        return [e for e in self.events if isinstance(e, DuplexOut)]


def frames(seed, count):
    rng = np.random.default_rng(seed)
    out = [0.2 * rng.standard_normal(FRAME).astype(np.float32) for _ in range(count)]
    for k in range(2, 4):
        out[k] = np.zeros(FRAME, np.float32)
    return out


@pytest.fixture
def echo_engine():
    eng = Engine(EchoModel(duplex_lag_frames=2), EngineConfig(max_sessions=8))
    eng.start()
    yield eng
    eng.stop()


def test_sessions_joining_at_different_times_get_their_input_lagged_on_the_timeline(echo_engine):
    eng, count = echo_engine, 12
    inputs = {name: frames(i, count) for i, name in enumerate("abc")}
    got = {name: Collector() for name in inputs}
    # A turn-based prefix before the switch: the duplex timeline continues from it.
    eng.open("a", got["a"])
    eng.push_audio("a", np.zeros(FRAME // 2, np.float32))
    eng.clear_input("a")
    eng.set_duplex("a", True)
    for k in range(count):
        if k == 4:
            eng.open("b", got["b"])
            eng.set_duplex("b", True)
        if k == 7:
            eng.open("c", got["c"])
            eng.set_duplex("c", True)
        for name, joined in (("a", 0), ("b", 4), ("c", 7)):
            if k >= joined:
                eng.push_audio(name, inputs[name][k - joined])
    until(lambda: all(len(got[n].out()) == count - j for n, j in (("a", 0), ("b", 4), ("c", 7))),
          "every pushed frame answered")
    for name, joined in (("a", 0), ("b", 4), ("c", 7)):
        outs = got[name].out()
        origin = outs[0].media_start - FRAME
        assert [o.index - outs[0].index for o in outs] == list(range(count - joined))
        for k, o in enumerate(outs):
            # Output at timeline sample p repeats input at p - lag frames.
            assert o.media_start == origin + (k + 1) * FRAME
            source = k - 1
            want = inputs[name][source] if source >= 0 else np.zeros(FRAME, np.float32)
            assert np.array_equal(o.pcm, want), (name, k)
            assert o.voiced == bool(want.any())
    # While open, each holds its lag's buffered frame; closed, nothing at all.
    eng.wait_idle()
    assert eng.bytes_by_session() == {name: FRAME * 4 for name in inputs}
    for name in inputs:
        eng.close(name)
    eng.wait_idle()
    assert eng.total_bytes_held() == 0
    # Ticks were shared: some model steps took more than one session.
    until(lambda: eng.wait_idle() and max(eng.stats.stages["duplex_echo"].batch_sizes) > 1,
          "a tick that stepped several sessions at once")


def test_cancel_fences_output_and_the_model_keeps_listening(echo_engine):
    eng, got = echo_engine, Collector()
    eng.open("s", got)
    eng.set_duplex("s", True)
    sent = frames(9, 8)
    for pcm in sent[:4]:
        eng.push_audio("s", pcm)
    until(lambda: len(got.out()) == 4, "four frames out")
    eng.cancel("s", 1)
    for pcm in sent[4:]:
        eng.push_audio("s", pcm)
    until(lambda: len(got.out()) == 8, "eight frames out")
    outs = got.out()
    assert [o.epoch for o in outs] == [0] * 4 + [1] * 4
    # The lag's buffered frame survived the cancel: the echo is unbroken across it.
    assert np.array_equal(outs[4].pcm, sent[3]) and np.array_equal(outs[7].pcm, sent[6])


class SlowClock:
    """The engine's clock: real time, plus a slow model's extra time per step. The model seems
    to take that long without the test sleeping through it."""

    def __init__(self):
        self.extra_s = 0.0

    def __call__(self):
        return time.monotonic() + self.extra_s


class SlowEcho(EchoModel):
    """Echo whose duplex step costs more than a frame on `clock` once `slow` is set."""

    def __init__(self, clock: SlowClock):
        super().__init__(duplex_lag_frames=1)
        self.clock = clock
        self.slow = threading.Event()

    def duplex_step(self, states, frames, timer=None):
        if self.slow.is_set():
            self.clock.extra_s += 0.15
        return super().duplex_step(states, frames)


def test_falling_behind_drops_and_resyncs_and_admission_refuses_more():
    clock = SlowClock()
    model = SlowEcho(clock)
    eng = Engine(model, EngineConfig(max_sessions=8, duplex_max_lag_ms=300), clock)
    eng.start()
    try:
        got = Collector()
        eng.open("s", got)
        eng.set_duplex("s", True)
        # Opened while the engine is idle; asks for duplex once ticks cost more than a frame.
        eng.open("t", Collector())
        model.slow.set()
        sent = frames(5, 40)
        start = clock()
        for k, pcm in enumerate(sent):
            # The client sends at real time (80 ms a frame); the model takes 150 ms a frame.
            until(lambda k=k: clock() >= start + k * 0.08, f"frame {k} due", 30.0)
            eng.push_audio("s", pcm)
        until(lambda: got.out() and got.out()[-1].index == 39, "the last frame answered")
        outs = got.out()
        dropped = sum(e.n_samples for e in got.events if isinstance(e, DuplexDropped))
        assert dropped and dropped % FRAME == 0
        assert len(outs) + dropped // FRAME == 40
        # Latency stays bounded: never more than the lag limit plus a couple of slow steps.
        assert max(o.late_ms for o in outs) < 300 + 2 * 150 + 100
        # Each output is still the input frame of its own index, on its own timeline place.
        for o in outs:
            assert np.array_equal(o.pcm, sent[o.index])
            assert o.media_start == (o.index + 1) * FRAME
        eng.wait_idle()
        drops = [d for d in eng.drain_drops() if d.kind == "duplex_frame"]
        assert sum(d.n for d in drops if d.reason == "behind") == dropped // FRAME
        with pytest.raises(AdmissionRefused) as refused:
            eng.set_duplex("t", True)
        assert refused.value.limit == "engine.max_load"
    finally:
        eng.stop()
