"""`duplex bench --turns`: when a reply starts, with server_vad and with semantic_vad, in one run.

Sessions speak recorded human speech (duplex.bench.prompts: Smart Turn is near chance on
synthetic speech) in real time through the same Realtime session loop, speech detector,
end-of-turn model and engine as the server, every session of a pass with the same turn
detection. Each session alternates a finished sentence with the same kind of sentence paused
600-900 ms between two words in its middle, listening to each reply to its end. Reported per
mode:

- `ttfa_ms`: the end of a finished sentence to the first reply audio the client receives
  (p50 / p95), and what it is made of: the turn decision reaching the client
  (`decision_ms`, the end of speech to speech_stopped), then the engine's own work counted
  from the commit (`engine`: the input queued before the reply, the Thinker's first token,
  the Talker's first codes, the codec's first audio, from duplex.response.timings), then what
  follows the codec's first audio until the client has it (`delivery_ms`: the engine's event
  crossing to the session loop, pacing, the socket);
- `early_replies`: how many of the paused sentences got a reply before they were finished
  (the turn ended in the pause), of how many; `finished_cut_off`: the same for the finished
  sentences (a short pause between their words judged their end);
- how the turns ended (silence, model, fallback) and the end-of-turn model's cost per call.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from duplex.bench.prompts import prompts
from duplex.bench.run import FRAME, RATE, SILENCE, _append_events
from duplex.engine import ChildSpec, EngineConfig, SchedulerConfig, start_engine
from duplex.engine.stats import percentiles
from duplex.engine.vad import VadService
from duplex.media.echo import warm_up as echo_guard_warm_up
from duplex.observability.metrics import Metrics
from duplex.smart_turn import SmartTurn, TurnEndService, fetch
from duplex.transport.realtime.protocol import Limits
from duplex.transport.realtime.session import RealtimeSession

MODES = ("server_vad", "semantic_vad")
PAUSE_S = (0.6, 0.9)
REPLY_LIMIT_S = 20.0
"""A turn whose reply has not ended this long after the speech is given up on (counted)."""
STAGES = ("input", "thinker_first_token", "talker_first_codes", "codec_first_audio")


@dataclass
class TurnRecord:
    ttfa_ms: list[float] = field(default_factory=list)
    decision_ms: list[float] = field(default_factory=list)
    engine_ms: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    delivery_ms: list[float] = field(default_factory=list)
    paused: int = 0
    early: int = 0
    finished: int = 0
    cut_off: int = 0
    """Finished sentences replied to before their end (a pause inside them judged the end)."""
    cut_off_last: bool = False
    unanswered: int = 0


class TurnClient:
    """One session's caller: finished and paused sentences in turn, each heard out."""

    def __init__(self, index: int, duration_s: float, seed: int) -> None:
        self.index = index
        self.duration_s = duration_s
        self.rng = random.Random((seed << 32) | index)
        self.session: RealtimeSession | None = None
        self.rec = TurnRecord()
        self.events: list[tuple[float, dict]] = []
        self.replying = False
        self.heard: set[str] = set()
        """Replies whose first audio has come (only the first delta of each is kept)."""

    async def on_event(self, text: str) -> None:
        event = json.loads(text)
        kind = event["type"]
        if kind == "response.output_audio.delta":
            if event["response_id"] not in self.heard:
                self.heard.add(event["response_id"])
                self.events.append((time.monotonic(), {"type": kind}))
            return
        if kind.startswith(("response.output_audio_transcript", "conversation")):
            return
        self.events.append((time.monotonic(), event))
        if kind == "response.created":
            self.replying = True
        elif kind == "response.done":
            self.replying = False

    async def _send(self, frames: list[str], t: float) -> float:
        """Each frame once it has been captured (as a live microphone sends it)."""
        for i, message in enumerate(frames):
            await asyncio.sleep(max(0.0, t + (i + 1) * FRAME / RATE - time.monotonic()))
            self.session.feed_text(message)
        return t + len(frames) * FRAME / RATE

    def _settled(self, since: float) -> bool:
        """Every turn since `since` has been committed and its reply heard to its end (or a
        false interruption let the reply go on): the caller may speak again."""
        last: dict[str, float] = {}
        for at, e in self.events:
            if at >= since:
                last[e["type"]] = at
        replied = "response.created" in last and not self.replying
        open_turn = last.get("input_audio_buffer.speech_started", 0.0) > max(
            last.get("input_audio_buffer.speech_stopped", 0.0),
            last.get("duplex.output.resumed", 0.0))
        unanswered = last.get("input_audio_buffer.speech_stopped", 0.0) > last.get(
            "response.created", 0.0)
        return replied and not open_turn and not unanswered

    async def _quiet_until_replied(self, t: float, said_at: float) -> float:
        """Silence until the replies to what was said have been heard to their end."""
        while time.monotonic() - said_at < REPLY_LIMIT_S:
            t = await self._send([SILENCE], t)
            if self._settled(said_at):
                return t
        self.rec.unanswered += 1
        return t

    async def run(self, started: float, sentences: list[tuple[list[str], list[str] | None]]) -> None:
        t = started + self.rng.uniform(0, 1.0)
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        end = started + self.duration_s
        k = self.index
        while t < end - 4.0:
            whole, parts = sentences[k % len(sentences)]
            k += 1
            paused = k % 2 == 0
            said_at = t
            if paused:
                head, tail = parts
                t = await self._send(head, t)
                pause = round(self.rng.uniform(*PAUSE_S) * RATE / FRAME)
                t = await self._send([SILENCE] * pause, t)
                t = await self._send(tail, t)
                finished = t
                self.rec.paused += 1
                if any(e["type"] == "response.created" for at, e in self.events if at >= said_at):
                    self.rec.early += 1
            else:
                t = await self._send(whole, t)
                finished = t
                self.rec.finished += 1
                self.rec.cut_off_last = any(e["type"] == "response.created"
                                            for at, e in self.events if at >= said_at)
                self.rec.cut_off += self.rec.cut_off_last
            t = await self._quiet_until_replied(t, said_at)
            if not paused and not self.rec.cut_off_last:
                self._time(finished)
            t = await self._send([SILENCE] * round(self.rng.uniform(0.4, 0.8) * RATE / FRAME), t)

    def _time(self, finished: float) -> None:
        """The finished sentence's reply, from the end of its speech, part by part."""
        after = [(at, e) for at, e in self.events if at >= finished]
        stopped = next((at for at, e in after if e["type"] == "input_audio_buffer.speech_stopped"), None)
        audio = next((at for at, e in after if e["type"] == "response.output_audio.delta"), None)
        timings = next((e["timings_ms"] for _, e in after if e["type"] == "duplex.response.timings"
                        and e["timings_ms"].get("codec_first_audio") is not None), None)
        if stopped is None or audio is None:
            return
        self.rec.ttfa_ms.append((audio - finished) * 1000)
        self.rec.decision_ms.append((stopped - finished) * 1000)
        if timings is not None:
            for stage in STAGES:
                self.rec.engine_ms[stage].append(timings[stage])
            self.rec.delivery_ms.append((audio - stopped) * 1000 - timings["codec_first_audio"])

def _sentences() -> list[tuple[list[str], tuple[list[str], list[str]]]]:
    """Each recording as append events: whole, and cut at its middle pause (head, tail)."""
    out = []
    for p in prompts(RATE):
        a, b = p.pause
        out.append((_append_events(p.pcm), (_append_events(p.pcm[:a]), _append_events(p.pcm[b:]))))
    return out


async def run_pass(engine, vad: VadService, mode: str, sessions: int, duration_s: float,
                   seed: int) -> dict:
    engine.wait_idle()
    sentences = _sentences()
    clients = [TurnClient(i, duration_s, seed) for i in range(sessions)]
    scored_before, busy_before = vad.turn_end.scored, vad.turn_end.busy_s
    dropped_before = vad.turn_end.dropped
    # What ended each turn, as /metrics counts it.
    metrics = Metrics(engine.model.name)
    runners = []
    started = time.monotonic()
    for c in clients:
        c.session = RealtimeSession(engine, vad, Limits(), engine.model.name, c.on_event,
                                    session_id=f"turns_{mode}_{c.index}", duplex_events=True,
                                    metrics=metrics)
        c.session.open()
        c.session.feed_text(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": {"type": mode}}}}}))
        runners.append(asyncio.create_task(c.session.run()))
    try:
        await asyncio.gather(*(c.run(started, sentences) for c in clients))
    finally:
        for c in clients:
            c.session.carrier_gone()
        await asyncio.gather(*runners, return_exceptions=True)
    merged = TurnRecord()
    for c in clients:
        merged.ttfa_ms += c.rec.ttfa_ms
        merged.decision_ms += c.rec.decision_ms
        merged.delivery_ms += c.rec.delivery_ms
        for stage in STAGES:
            merged.engine_ms[stage] += c.rec.engine_ms[stage]
        merged.paused += c.rec.paused
        merged.early += c.rec.early
        merged.finished += c.rec.finished
        merged.cut_off += c.rec.cut_off
        merged.unanswered += c.rec.unanswered
    scored = vad.turn_end.scored - scored_before
    busy = vad.turn_end.busy_s - busy_before
    return {
        "mode": mode,
        "sessions": sessions,
        "ttfa_ms": percentiles(merged.ttfa_ms),
        "decision_ms": percentiles(merged.decision_ms),
        "engine_ms": {stage: percentiles(v) for stage, v in merged.engine_ms.items()},
        "delivery_ms": percentiles(merged.delivery_ms),
        "early_replies": {"n": merged.early, "of": merged.paused,
                          "share": round(merged.early / merged.paused, 3) if merged.paused else None},
        "finished_cut_off": {"n": merged.cut_off, "of": merged.finished},
        "unanswered": merged.unanswered,
        "turns_ended_by": {by: int(metrics.turns_ended.labels(by)._value.get())
                           for by in ("silence", "model", "fallback")},
        "smart_turn_calls": scored,
        "smart_turn_dropped": vad.turn_end.dropped - dropped_before,
        "smart_turn_ms_per_call": round(busy * 1000 / scored, 1) if scored else None,
    }


def bench_turns(model_name: str, cache_dir: str, sessions: int, duration_s: float, log=print,
                torch_threads: int = 0, scheduler: dict | None = None, in_process: bool = False,
                dtype: str = "auto", seed: int = 0, turn_threads: int = 1) -> dict:
    turn_end = TurnEndService(SmartTurn(fetch(cache_dir), turn_threads))
    vad = VadService(turn_end=turn_end)
    echo_guard_warm_up()
    spec = ChildSpec(model_name, cache_dir, "auto",
                     EngineConfig(max_sessions=max(64, sessions), max_load=float("inf"),
                                  scheduler=SchedulerConfig(**(scheduler or {}))),
                     torch_threads, dtype=dtype)
    engine = start_engine(spec, in_process)
    passes = {}
    try:
        for mode in MODES:
            log(f"  {mode}: {sessions} sessions for {duration_s:g} s")
            passes[mode] = asyncio.run(run_pass(engine, vad, mode, sessions, duration_s, seed))
    finally:
        engine.stop()
        vad.stop()
    return {"model": engine.model.name, "device": engine.model.device, "sessions": sessions,
            "duration_s": duration_s, "seed": seed, "speech": "duplex.bench.prompts (recorded)",
            "modes": passes}


def table(report: dict) -> str:
    def pq(d) -> str:
        return "-" if d["p50"] is None else f"{d['p50']:.0f} / {d['p95']:.0f} ({d['n']})"

    modes = report["modes"]
    rows = [("", *modes)]

    def row(label, fn):
        rows.append((label, *(fn(m) for m in modes.values())))

    row("end of sentence -> first audio ms p50/p95 (n)", lambda m: pq(m["ttfa_ms"]))
    row("  turn decision at the client", lambda m: pq(m["decision_ms"]))
    for stage in STAGES:
        row(f"  engine {stage} (from commit)", lambda m, s=stage: pq(m["engine_ms"][s]))
    row("  delivery after codec first audio", lambda m: pq(m["delivery_ms"]))
    row("paused sentences replied to early",
        lambda m: f"{m['early_replies']['n']} of {m['early_replies']['of']}")
    row("finished sentences replied to before their end",
        lambda m: f"{m['finished_cut_off']['n']} of {m['finished_cut_off']['of']}")
    row("turns ended by", lambda m: ", ".join(f"{k} {v}" for k, v in sorted(m["turns_ended_by"].items())))
    row("unanswered turns", lambda m: str(m["unanswered"]))
    row("smart turn turns scored (ms each), dropped unwanted",
        lambda m: f"{m['smart_turn_calls']} ({m['smart_turn_ms_per_call'] or '-'}), "
                  f"{m['smart_turn_dropped']}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"model {report['model']} on {report['device']}, {report['sessions']} sessions, "
                 f"{report['duration_s']:g} s per mode, recorded human speech (Asterisk prompts)")
    return "\n".join(lines)
