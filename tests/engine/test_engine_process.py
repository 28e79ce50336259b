"""What only an engine in a process of its own can do: fail to start, and die under a session."""

import os
import signal
import threading

import numpy as np
import pytest

from duplex.bench.codec import stream_vs_offline
from duplex.engine import (
    AdmissionRefused,
    ChildSpec,
    EngineConfig,
    EngineProcess,
    EngineStartFailed,
    ResponseFinished,
    SessionFailed,
)
from duplex.engine.process import split_cpus
from models.echo import EchoModel


def test_a_missing_checkpoint_fails_the_start_with_the_childs_reason(tmp_path):
    engine = EngineProcess(ChildSpec(str(tmp_path / "nowhere"), str(tmp_path), "cpu",
                                     EngineConfig(), torch_threads=1))
    with pytest.raises(EngineStartFailed, match=r"no model checkpoint at .*nowhere"):
        engine.start()


def test_the_model_facts_callers_need_come_back_from_the_child():
    engine = EngineProcess(ChildSpec("echo", ".models", "cpu", EngineConfig(), torch_threads=1))
    engine.start()
    try:
        assert (engine.model.name, engine.model.input_rate, engine.model.output_rate) == (
            "echo", 24000, 24000)
        assert engine.model.device == "cpu"
        assert engine.query(stream_vs_offline) is None  # echo has no codec to measure
    finally:
        engine.stop()


def test_a_call_that_raises_in_the_child_is_answered_and_the_engine_serves_on():
    engine = EngineProcess(ChildSpec("echo", ".models", "cpu", EngineConfig(), torch_threads=1))
    engine.start()
    try:
        with pytest.raises(RuntimeError, match=r"new_state failed in the engine: TypeError"):
            engine.query(EchoModel.new_state)  # without a session id
        finished = threading.Event()
        engine.open("a", lambda e: isinstance(e, ResponseFinished) and finished.set())
        engine.push_audio("a", np.ones(4800, np.float32))
        engine.commit("a", 0)
        assert finished.wait(5)
        assert engine.alive
    finally:
        engine.stop()


def test_a_dead_engine_process_fails_its_sessions_and_refuses_new_ones():
    engine = EngineProcess(ChildSpec("echo", ".models", "cpu", EngineConfig(), torch_threads=1))
    engine.start()
    failed = threading.Event()
    events = []

    def deliver(event):
        events.append(event)
        if isinstance(event, SessionFailed):
            failed.set()

    try:
        engine.open("a", deliver)
        engine.push_audio("a", np.ones(4800, np.float32))
        assert engine.wait_idle()
        os.kill(engine.pid, signal.SIGKILL)
        assert failed.wait(5)
        assert events[-1].session_id == "a"
        assert "engine process" in events[-1].message
        assert not any(isinstance(e, ResponseFinished) for e in events)
        with pytest.raises(AdmissionRefused, match="engine process is not running") as info:
            engine.open("b", deliver)
        assert info.value.limit == "engine.process"
        assert engine.total_bytes_held() == 0
        assert not engine.alive
        # The session's own calls still on their way are moot now, not errors.
        engine.push_audio("a", np.ones(4800, np.float32))
        engine.commit("a", 1)
        assert engine.wait_idle() is False
        with pytest.raises(RuntimeError, match="engine process is not running"):
            engine.query(stream_vs_offline)
    finally:
        engine.stop()



def _threads_cpus() -> list[set[int]]:
    return [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")]


def test_pinned_the_engine_and_this_process_split_the_cpus_and_this_one_gets_its_back():
    mine = os.sched_getaffinity(0)
    engine = EngineProcess(ChildSpec("echo", ".models", "cpu", EngineConfig(), torch_threads=1,
                                     pin_cpus=True))
    engine.start()
    try:
        child = os.sched_getaffinity(engine.pid)
        if len(mine) < 2:
            # Nothing to split: both run where they may.
            assert split_cpus(1) is None and child == mine
        else:
            assert child == {max(mine)}
            assert all(t == mine - child for t in _threads_cpus())
    finally:
        engine.stop()
    assert all(t == mine for t in _threads_cpus())


def test_unpinned_the_engine_may_run_anywhere():
    mine = os.sched_getaffinity(0)
    engine = EngineProcess(ChildSpec("echo", ".models", "cpu", EngineConfig(), torch_threads=1))
    engine.start()
    try:
        assert os.sched_getaffinity(engine.pid) == mine and os.sched_getaffinity(0) == mine
    finally:
        engine.stop()
