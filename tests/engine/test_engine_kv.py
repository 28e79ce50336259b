"""Admission by KV memory through the engine: a session that would not fit is refused naming KV
memory, a reply without room ends with server_full, and no session ever fails for want of it."""

import threading

import pytest

from duplex.engine import AdmissionRefused, Engine, EngineConfig, ResponseFinished, SessionFailed
from models.qwen3_omni.adapter import Qwen3OmniAdapter
from models.reply import ReplySpec
from tests.models.test_kv_memory import OPTIONS, TWO_SESSIONS


class Sink:
    def __init__(self) -> None:
        self.finished: list[ResponseFinished] = []
        self.failed: list[SessionFailed] = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, ResponseFinished):
            self.finished.append(event)
            self.done.set()
        elif isinstance(event, SessionFailed):
            self.failed.append(event)


def reply(engine, sid: str, sink: Sink, audio: bool = False) -> ResponseFinished:
    sink.done.clear()
    engine.commit(sid, 0, ReplySpec(audio=audio, temperature=0.0))
    assert sink.done.wait(60)
    return sink.finished[-1]


def test_sessions_and_replies_are_admitted_by_kv_memory(tiny_omni_dir):
    model = Qwen3OmniAdapter.from_pretrained(tiny_omni_dir, options=OPTIONS,
                                             kv_memory=TWO_SESSIONS)
    engine = Engine(model, EngineConfig(max_sessions=8))
    engine.start()
    sinks = {sid: Sink() for sid in "abc"}
    try:
        for sid in "ab":
            engine.open(sid, sinks[sid])
            engine.push_text(sid, "x" * 190)
            assert reply(engine, sid, sinks[sid]).reason == "completed"
        assert engine.wait_idle()
        assert engine.kv_stats["thinker"].blocks_free == 0
        with pytest.raises(AdmissionRefused, match="KV memory is full") as refused:
            engine.open("c", sinks["c"])
        assert refused.value.limit == "engine.kv_memory"
        # The Talker pool holds two replies' audio: of three asked together, one fails with
        # server_full (and is answered when asked again).
        engine.close("b")
        assert engine.wait_idle()
        for sid in "bc":
            engine.open(sid, sinks[sid])
        for sid in "abc":
            engine.push_text(sid, "y")
            sinks[sid].done.clear()
            engine.commit(sid, 0, ReplySpec(temperature=0.0))
        for sid in "abc":
            assert sinks[sid].done.wait(60)
        reasons = sorted(sinks[sid].finished[-1].reason for sid in "abc")
        assert reasons == ["completed", "completed", "server_full"]
        again = next(sid for sid in "abc" if sinks[sid].finished[-1].reason == "server_full")
        assert reply(engine, again, sinks[again], audio=True).reason == "completed"
        assert not any(sink.failed for sink in sinks.values())
    finally:
        engine.stop()
