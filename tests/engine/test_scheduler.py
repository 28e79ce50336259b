"""The scheduler's plans, checked without any model."""

import numpy as np
import pytest

from duplex.engine.payload import Kind
from duplex.engine.scheduler import (
    AudioOut,
    EngineFull,
    ResponseFinished,
    Scheduler,
    SchedulerConfig,
    Stage,
    StageResults,
    TextOut,
    ToolCallOut,
)
from duplex.engine.thinker_text import CallDone
from models.base import TalkerFrame, ThinkerToken
from models.reply import ReplySpec


def results_of(by_stage):
    results = StageResults()
    for stage, out in by_stage.items():
        results.put(stage, out)
    return results


def stages(plan):
    return {b.stage: [e.session_id for e in b.entries] for b in plan.batches}


NOW = SchedulerConfig(encode_wait_s=0.0)


def test_ready_work_of_all_sessions_shares_one_batch_per_stage():
    s = Scheduler(4, NOW)
    for sid in "abc":
        s.add_session(sid)
        s.push_input(sid, np.zeros(1920, np.float32), 0.0, "v")
    plan = s.schedule(0.0)
    assert stages(plan) == {Stage.ENCODE: ["a", "b", "c"]}
    assert [e.slot for e in plan.batches[0].entries] == [0, 1, 2]


def test_max_batch_leaves_the_rest_queued_in_order():
    s = Scheduler(4, SchedulerConfig(max_batch=2, encode_wait_s=0.0))
    for sid in "abc":
        s.add_session(sid)
        s.push_input(sid, np.zeros(10, np.float32), 0.0, "v")
    assert stages(s.schedule(0.0)) == {Stage.ENCODE: ["a", "b"]}
    assert stages(s.schedule(0.0)) == {Stage.ENCODE: ["c"]}


def test_reply_begins_only_after_committed_input_is_prefilled():
    s = Scheduler(2, NOW)
    s.add_session("a")
    s.push_input("a", np.zeros(10, np.float32), 0.0, "v")
    s.commit("a", 0)
    plan = s.schedule(0.0)
    assert stages(plan) == {Stage.ENCODE: ["a"]} and not plan.begin
    s.update(plan, results_of({Stage.ENCODE: ["feat"]}), 0.0, "v")
    plan = s.schedule(0.0)
    assert stages(plan) == {Stage.PREFILL: ["a"]} and not plan.begin
    s.update(plan, results_of({Stage.PREFILL: [None]}), 0.0, "v")
    plan = s.schedule(0.0)
    assert [e.session_id for e in plan.begin] == ["a"]
    assert stages(plan) == {}
    assert stages(s.schedule(0.0)) == {Stage.THINKER: ["a"]}


def run_reply(s, sid, tokens):
    """Drive one reply through the stages with canned results; return what came out."""
    out = []
    for _ in range(100):
        plan = s.schedule(0.0)
        results = {}
        for b in plan.batches:
            if b.stage is Stage.THINKER:
                results[b.stage] = [tokens.pop(0) for _ in b.entries]
            elif b.stage is Stage.TALKER:
                results[b.stage] = [
                    TalkerFrame(np.ones(2) if e.payload else None, bool(e.payload and e.payload.final))
                    for e in b.entries
                ]
            elif b.stage is Stage.CODEC:
                results[b.stage] = [np.zeros(1920, np.float32) for _ in b.entries]
            else:
                results[b.stage] = [None for _ in b.entries]
        out += s.update(plan, results_of(results), 0.0, "v")
        if out and isinstance(out[-1], ResponseFinished):
            return out
    raise AssertionError("reply never finished")


def begin(s, sid, spec=None):
    s.commit(sid, s.sessions[sid].epoch, spec=spec)
    assert s.schedule(0.0).begin


def stages_run(s, sid, tokens):
    """Like run_reply, but also the stages that ran."""
    ran = set()
    out = []
    for _ in range(100):
        plan = s.schedule(0.0)
        ran |= {b.stage for b in plan.batches}
        results = {b.stage: [tokens.pop(0) for _ in b.entries] for b in plan.batches
                   if b.stage is Stage.THINKER}
        out += s.update(plan, results_of(results), 0.0, "v")
        if out and isinstance(out[-1], ResponseFinished):
            return ran, out
    raise AssertionError("reply never finished")


def test_a_text_only_reply_runs_the_thinker_alone_and_sends_its_text():
    s = Scheduler(2)
    s.add_session("a")
    begin(s, "a", ReplySpec(audio=False))
    ran, out = stages_run(s, "a", [ThinkerToken("hel", None, False),
                                   ThinkerToken("lo", None, True)])
    assert ran == {Stage.THINKER}
    assert out == [TextOut("a", 0, "hel"), TextOut("a", 0, "lo"), ResponseFinished("a", 0, 0)]


def test_a_reply_cut_at_its_token_limit_ends_with_that_reason():
    s = Scheduler(2)
    s.add_session("a")
    begin(s, "a", ReplySpec(audio=False, max_output_tokens=2))
    _, out = stages_run(s, "a", [ThinkerToken(w, None, False) for w in ("a", "b", "c")])
    assert out[-1] == ResponseFinished("a", 0, 0, "max_output_tokens")
    assert [o.text for o in out if isinstance(o, TextOut)] == ["a", "b"]


def test_a_tool_call_goes_out_apart_and_is_never_voiced():
    s = Scheduler(2)
    s.add_session("a")
    begin(s, "a")
    written = ['Sure. <tool_call>{"name": "f", ', '"arguments": {"x": 1}}', "</tool_call>", " ok"]
    tokens = [ThinkerToken(t, None, i == len(written) - 1) for i, t in enumerate(written)]
    out = run_reply(s, "a", tokens)
    voiced = "".join(o.text for o in out if isinstance(o, AudioOut))
    assert voiced == "Sure.  ok"
    [done] = [o.piece for o in out if isinstance(o, ToolCallOut) and isinstance(o.piece, CallDone)]
    assert (done.name, done.arguments, done.valid) == ("f", '{"x": 1}', True)


def test_a_reply_flows_thinker_talker_codec_with_text_attached():
    s = Scheduler(2)
    s.add_session("a")
    begin(s, "a")
    tokens = [ThinkerToken("hi ", None, False), ThinkerToken("there", None, True)]
    out = run_reply(s, "a", tokens)
    audio = [o for o in out if isinstance(o, AudioOut)]
    assert [a.text for a in audio] == ["hi ", "there"]
    assert [a.media_start for a in audio] == [0, 1920]
    assert out[-1] == ResponseFinished("a", 0, 3840)


def test_cancel_drops_reply_payloads_but_keeps_user_input():
    s = Scheduler(2)
    s.add_session("a")
    begin(s, "a")
    plan = s.schedule(0.0)
    s.update(plan, results_of({Stage.THINKER: [ThinkerToken("x", None, False)]}), 0.0, "v")
    s.push_input("a", np.zeros(480, np.float32), 0.0, "v")
    s.cancel("a", 1)
    sq = s.sessions["a"]
    assert not sq.queues[Kind.TOKENS] and sq.response is None
    assert len(sq.queues[Kind.PCM_IN]) == 1
    assert [(d.kind, d.reason) for d in s.drops] == [(Kind.TOKENS, "stale_epoch")]


def test_results_planned_before_a_cancel_are_dropped_not_routed():
    s = Scheduler(2)
    s.add_session("a")
    begin(s, "a")
    plan = s.schedule(0.0)
    s.cancel("a", 1)
    out = s.update(plan, results_of({Stage.THINKER: [ThinkerToken("late", None, False)]}), 0.0, "v")
    assert out == [] and not s.sessions["a"].queues[Kind.TOKENS]
    assert s.drops[-1].reason == "stale_epoch"


def test_a_reused_slot_never_receives_the_previous_owners_result():
    s = Scheduler(1, NOW)
    s.add_session("old")
    s.push_input("old", np.zeros(10, np.float32), 0.0, "v")
    plan = s.schedule(0.0)
    s.remove_session("old")
    assert s.add_session("new") == 0
    s.update(plan, results_of({Stage.ENCODE: ["old's features"]}), 0.0, "v")
    assert not s.sessions["new"].queues[Kind.FEATURES]
    assert s.drops[-1].reason == "slot_reassigned"


def test_full_engine_is_refused_by_name():
    s = Scheduler(1)
    s.add_session("a")
    with pytest.raises(EngineFull, match="all 1 engine slots"):
        s.add_session("b")


def test_talker_waits_when_audio_runs_ahead_of_real_time():
    s = Scheduler(1, SchedulerConfig(audio_lead_s=0.5, output_rate=24000))
    s.add_session("a")
    begin(s, "a")
    r = s.sessions["a"].response
    r.thinker_done = True
    r.first_audio_at = 10.0
    r.emitted_samples = 24000
    assert Stage.TALKER not in stages(s.schedule(10.4))
    assert Stage.TALKER in stages(s.schedule(10.6))


def test_input_chunks_wait_briefly_so_sessions_share_an_encode():
    s = Scheduler(4, SchedulerConfig(encode_wait_s=0.03))
    s.add_session("a")
    s.add_session("b")
    s.push_input("a", np.zeros(10, np.float32), 10.00, "v")
    assert stages(s.schedule(10.01)) == {}
    s.push_input("b", np.zeros(10, np.float32), 10.02, "v")
    assert stages(s.schedule(10.04)) == {Stage.ENCODE: ["a", "b"]}


def test_talkers_due_soon_join_the_one_that_is_due():
    s = Scheduler(3, SchedulerConfig(audio_lead_s=1.0, batch_window_s=0.4))
    for sid, ahead in (("due", 0.9), ("soon", 1.2), ("later", 1.6)):
        s.add_session(sid)
        begin(s, sid)
        r = s.sessions[sid].response
        r.thinker_done = True
        r.first_audio_at = 0.0
        r.emitted_samples = int(ahead * 24000)
    assert stages(s.schedule(0.0)) == {Stage.TALKER: ["due", "soon"]}


def test_input_enters_the_thinker_in_arrival_order_across_audio_and_video():
    s = Scheduler(1, SchedulerConfig(encode_wait_s=1.0))
    s.add_session("a")
    s.push_input("a", np.zeros(10, np.float32), 0.5, "v")  # seq 0, still waiting at t=1
    s.push_frame("a", np.zeros((4, 4, 3), np.uint8), 0.0, "v")  # seq 1, due at t=1
    plan = s.schedule(1.0)
    assert stages(plan) == {Stage.VISION: ["a"]}
    s.update(plan, results_of({Stage.VISION: ["frame features"]}), 0.0, "v")
    assert Stage.PREFILL not in stages(s.schedule(1.0))  # seq 0 is not encoded yet
    plan = s.schedule(1.5)
    s.update(plan, results_of({Stage.ENCODE: ["audio features"]}), 0.0, "v")
    order = []
    for _ in range(2):
        plan = s.schedule(0.0)
        order += [e.payload.data for b in plan.batches if b.stage is Stage.PREFILL for e in b.entries]
        s.update(plan, results_of({b.stage: [None] * len(b.entries) for b in plan.batches}), 0.0, "v")
    assert order == ["audio features", "frame features"]
