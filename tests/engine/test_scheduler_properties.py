"""Invariants of the scheduler under arbitrary interleavings of input, replies, cancels, closes."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplex.engine.payload import INPUT_KINDS, Kind
from duplex.engine.scheduler import (
    AudioOut,
    EngineFull,
    Scheduler,
    SchedulerConfig,
    Stage,
    StageResults,
)
from models.base import TalkerFrame, ThinkerToken


def results_of(by_stage):
    results = StageResults()
    for stage, out in by_stage.items():
        results.put(stage, out)
    return results

SESSIONS = st.sampled_from(["a", "b", "c"])
ops = st.one_of(
    st.tuples(st.just("add"), SESSIONS),
    st.tuples(st.just("remove"), SESSIONS),
    st.tuples(st.just("push"), SESSIONS),
    st.tuples(st.just("frame"), SESSIONS),
    st.tuples(st.just("commit"), SESSIONS),
    st.tuples(st.just("cancel"), SESSIONS),
    st.tuples(st.just("clear"), SESSIONS),
    st.tuples(st.just("step"), st.booleans(), st.sampled_from(["a", "b", "c", None])),
)


def fake_results(plan, finish):
    results = {}
    for b in plan.batches:
        if b.stage is Stage.THINKER:
            results[b.stage] = [ThinkerToken("t", None, finish) for _ in b.entries]
        elif b.stage is Stage.TALKER:
            results[b.stage] = [TalkerFrame(np.zeros(2), finish) for _ in b.entries]
        elif b.stage is Stage.CODEC:
            results[b.stage] = [np.zeros(4, np.float32) for _ in b.entries]
        else:
            results[b.stage] = [f"feat-{e.payload.seq}" if e.payload else None for e in b.entries]
    return results


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, max_size=60))
def test_plans_are_consistent_and_stale_work_never_surfaces(script):
    s = Scheduler(2, SchedulerConfig(max_batch=2, encode_wait_s=0.0, audio_lead_s=100.0))
    now = 0.0
    for op in script:
        kind, sid = op[0], op[-1] if op[0] != "step" else op[2]
        present = sid in s.sessions
        if kind == "add" and not present:
            try:
                s.add_session(sid)
            except EngineFull:
                assert len(s.sessions) == 2
        elif kind == "remove" and present:
            s.remove_session(sid)
        elif kind == "push" and present:
            s.push_input(sid, np.zeros(8, np.float32), now, "v")
        elif kind == "frame" and present:
            s.push_frame(sid, np.zeros((2, 2, 3), np.uint8), now, "v")
        elif kind == "commit" and present:
            s.commit(sid, s.sessions[sid].epoch, now)
        elif kind == "cancel" and present:
            s.cancel(sid, s.sessions[sid].epoch + 1)
            sq = s.sessions[sid]
            assert all(p.kind in INPUT_KINDS for q in sq.queues.values() for p in q)
        elif kind == "clear" and present:
            s.clear_input(sid)
        elif kind == "step":
            now += 0.01
            plan = s.schedule(now)
            for b in plan.batches:
                ids = [e.session_id for e in b.entries]
                assert len(ids) == len(set(ids)) <= 2
                for e in b.entries:
                    assert s.slots[e.slot] == e.session_id
                    assert e.epoch == s.sessions[e.session_id].epoch
            if sid in s.sessions:  # something happens between planning and results
                s.cancel(sid, s.sessions[sid].epoch + 1)
            epochs = {k: sq.epoch for k, sq in s.sessions.items()}
            for event in s.update(plan, results_of(fake_results(plan, op[1])), now, "v"):
                assert event.session_id in s.sessions
                assert event.epoch == epochs[event.session_id]
                if isinstance(event, AudioOut):
                    assert event.media_start >= 0
        for sq in s.sessions.values():
            features = [p.seq for p in sq.queues[Kind.FEATURES]]
            assert features == sorted(features)
            assert sq.prefilled_seq <= sq.input_seq
        assert sorted(x for x in s.slots if x) == sorted(s.sessions)
