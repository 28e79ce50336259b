"""Paced sessions in-process: the same Realtime session loop, engine and VAD as the server, driven
by scripted clients that say recorded requests (duplex.bench.speech), wait, and talk over replies.

Each client streams 20 ms frames at real time, each sent once the whole frame could have been
captured, and times the server's decisions from the first sample of its speech. Its script
alternates a plain turn (speak, then listen to the whole reply) with a barge-in turn (speak
again shortly after the reply starts).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from duplex.bench import ceiling
from duplex.bench.arrivals import Script, scripts
from duplex.bench.codec import stream_vs_offline
from duplex.bench.kv import MIXED_SESSIONS, KVPeak, mixed_contexts
from duplex.bench.speech import utterances
from duplex.engine import ChildSpec, EngineConfig, SchedulerConfig, start_engine
from duplex.engine.engine import resolve_torch_threads
from duplex.engine.stats import percentiles
from duplex.engine.vad import VadService
from duplex.media import float_to_pcm16
from duplex.media.echo import warm_up as echo_guard_warm_up
from duplex.media.rates import REALTIME_RATE
from duplex.transport.realtime.protocol import Limits
from duplex.transport.realtime.session import RealtimeSession

RATE = REALTIME_RATE
FRAME = RATE // 50


@dataclass
class ClientRecord:
    ttfa_ms: list[float] = field(default_factory=list)
    vad_detect_ms: list[float] = field(default_factory=list)
    pause_ms: list[float] = field(default_factory=list)
    """Speech onset over a reply -> the reply paused (duplex.output.paused)."""
    barge_in_ms: list[float] = field(default_factory=list)
    input_lag_ms: list[float] = field(default_factory=list)
    underruns: int = 0
    reply_s: float = 0.0


class ScriptedClient:
    def __init__(self, index: int, duration_s: float, script: Script, seed: int = 0) -> None:
        self.index = index
        self.session: RealtimeSession | None = None
        self.duration_s = duration_s
        self.script = script
        self.rng = random.Random((seed << 32) | index)
        self.rec = ClientRecord()
        self.speech_onsets: list[float] = []
        self.speech_end: float | None = None
        self.awaiting_first_audio = False
        self.reply_start: float | None = None
        self.first_audio_at: float | None = None
        """When the reply now under way was first heard (reply_start moves on by its pauses)."""
        self.paused_at: float | None = None
        self.replies_heard = 0
        """Replies whose audio has started: a turn listens for the one after its own speech."""
        self.reply_audio_s = 0.0
        self.response_id: str | None = None
        self.last_delta_at: dict[str, float] = {}
        self.barge_decision: dict[str, float] = {}
        self.responses_done = asyncio.Event()
        # Encoded before the clock starts: a remote caller's own work is not the server's.
        self.turns = [
            _append_events(utterances(RATE)[said][: round(RATE * turn_s)])
            for said, turn_s in zip(script.utterance, script.turn_s, strict=True)
        ]

    def _onset(self, now: float) -> float | None:
        """The onset a speech decision at `now` answers: the latest one sent by then. Earlier
        ones still waiting got no decision of their own (a turn that ran into the one before
        it is one stretch of speech) and are dropped, not paired with a later decision."""
        past = [t for t in self.speech_onsets if t <= now]
        self.speech_onsets = [t for t in self.speech_onsets if t > now]
        return past[-1] if past else None

    async def on_event(self, text: str) -> None:
        now = time.monotonic()
        event = json.loads(text)
        kind = event["type"]
        if kind == "input_audio_buffer.speech_started" and (onset := self._onset(now)):
            self.rec.vad_detect_ms.append((now - onset) * 1000)
            if self.response_id is not None:
                self.barge_decision.setdefault(self.response_id, now)
        elif kind == "duplex.output.paused":
            # Over a reply the pause is the decision; speech_started waits for min_interruption.
            if onset := self._onset(now):
                ms = (now - onset) * 1000
                self.rec.vad_detect_ms.append(ms)
                # Speech that began before the reply was heard pauses it as it starts: that
                # wait is the reply's, not the detector's.
                if self.first_audio_at is not None and onset >= self.first_audio_at:
                    self.rec.pause_ms.append(ms)
            if self.response_id is not None:
                self.barge_decision[self.response_id] = now
            self.paused_at = now
        elif kind == "duplex.output.resumed":
            # A false interruption's gap is the server holding the reply on purpose, not the
            # engine falling behind: the listener's clock of the reply stops while it lasts.
            if self.reply_start is not None and self.paused_at is not None:
                self.reply_start += now - self.paused_at
            self.paused_at = None
        elif kind == "response.created":
            self.response_id = event["response"]["id"]
            self.reply_start = self.first_audio_at = None
            self.reply_audio_s = 0.0
            self.responses_done.clear()
        elif kind == "response.output_audio.delta":
            rid = event["response_id"]
            self.last_delta_at[rid] = now
            seconds = len(base64.b64decode(event["delta"])) / 2 / RATE
            if self.reply_start is None:
                self.reply_start = self.first_audio_at = now
                self.replies_heard += 1
                if self.awaiting_first_audio and self.speech_end is not None:
                    self.rec.ttfa_ms.append((now - self.speech_end) * 1000)
                self.awaiting_first_audio = False
            elif now > self.reply_start + self.reply_audio_s + 0.02:
                # The listener's buffer ran dry before this delta arrived.
                self.rec.underruns += 1
                self.reply_start = now - self.reply_audio_s
            self.reply_audio_s += seconds
            self.rec.reply_s += seconds
        elif kind == "response.done":
            rid = event["response"]["id"]
            if event["response"]["status"] == "cancelled" and rid in self.barge_decision:
                last = max(self.last_delta_at.get(rid, 0.0), now)
                self.rec.barge_in_ms.append((last - self.barge_decision[rid]) * 1000)
            self.response_id = None
            self.responses_done.set()

    async def _send_frames(self, frames: list[str], t_start: float) -> float:
        """Send append events of audio that starts at t_start, each when its last sample has
        been captured, as a live microphone can; returns when the audio ends."""
        for i, message in enumerate(frames):
            due = t_start + (i + 1) * FRAME / RATE
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            self.rec.input_lag_ms.append(max(0.0, time.monotonic() - due) * 1000)
            self.session.feed_text(message)
        return t_start + len(frames) * FRAME / RATE

    async def run(self, started: float) -> None:
        t = started + self.script.start_s
        end = started + self.duration_s
        turn = 0
        await asyncio.sleep(max(0.0, t - time.monotonic()))
        while time.monotonic() < end:
            k = turn % len(self.turns)
            speech = self.turns[k]
            self.speech_onsets.append(t)
            t = await self._send_frames(speech, t)
            self.speech_end = t
            self.awaiting_first_audio = True
            heard = self.replies_heard
            barge = self.script.barge_in[k]
            listen_until = None
            # Keep streaming silence (the microphone stays open) while the reply plays. The
            # reply is this turn's: one whose audio starts after the speech (the one before,
            # cut by this speech or heard to its end, says nothing of when to talk again).
            while time.monotonic() < end:
                t = await self._send_frames([SILENCE], t)
                if self.replies_heard > heard and listen_until is None:
                    listen_until = t + (self.rng.uniform(0.4, 0.8) if barge else 1e9)
                if listen_until is not None and t >= listen_until:
                    break
                if listen_until is not None and not barge and self.response_id is None:
                    pause = round(self.script.pause_s[k] * RATE / FRAME)
                    t = await self._send_frames([SILENCE] * pause, t)
                    break
                if listen_until is None and t - self.speech_end > 5.0:
                    break
            turn += 1


def _append_events(samples: np.ndarray) -> list[str]:
    """The append events that stream `samples` in 20 ms frames."""
    pcm = float_to_pcm16(samples)
    step = FRAME * 2
    return [
        json.dumps({"type": "input_audio_buffer.append",
                    "audio": base64.b64encode(pcm[i : i + step]).decode()})
        for i in range(0, len(pcm), step)
    ]


SILENCE = _append_events(np.zeros(FRAME, np.float32))[0]


def _rss_mb(engine) -> float:
    """Resident memory of this process and, when it has one, the engine's."""
    pids = ["self"] + ([str(engine.pid)] if getattr(engine, "pid", None) else [])
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(total / 1024, 1)


async def run_mode(engine, vad: VadService, sessions: int, duration_s: float,
                   arrivals: str = "herd", seed: int = 0) -> dict:
    engine.wait_idle()
    engine.stats.take()
    kv_peak = KVPeak(engine)
    sampler = asyncio.create_task(kv_peak.run())
    busy_before, steps_before = engine.stats.busy_s, engine.stats.steps
    cpu_before = engine.stats.busy_cpu_s
    runners = []
    started = time.monotonic()
    clients = [ScriptedClient(i, duration_s, script, seed)
               for i, script in enumerate(scripts(arrivals, sessions, duration_s, seed))]
    clock_start = time.monotonic()

    async def serve(client: ScriptedClient) -> None:
        """The session opens when its script starts, and runs to the end of the run."""
        await asyncio.sleep(max(0.0, clock_start + client.script.start_s - time.monotonic()))
        # duplex_events: the bench times the pause of a reply (duplex.output.paused).
        session = RealtimeSession(engine, vad, Limits(), engine.model.name, client.on_event,
                                  session_id=f"bench_{client.index}", duplex_events=True)
        session.open()
        client.session = session
        runners.append(asyncio.create_task(session.run()))
        await client.run(clock_start)

    try:
        await asyncio.gather(*(serve(c) for c in clients))
        held = [engine.bytes_held(c.session.session_id) for c in clients]
        kv_peak.sample()
    finally:
        sampler.cancel()
        opened = [c for c in clients if c.session is not None]
        for c in opened:
            c.session.carrier_gone()
        await asyncio.gather(*runners, return_exceptions=True)
        engine.wait_idle()
        left = sum(engine.bytes_held(c.session.session_id) for c in opened)
    wall = time.monotonic() - started
    merged = ClientRecord()
    for c in clients:
        for name in ("ttfa_ms", "vad_detect_ms", "pause_ms", "barge_in_ms", "input_lag_ms"):
            getattr(merged, name).extend(getattr(c.rec, name))
        merged.underruns += c.rec.underruns
        merged.reply_s += c.rec.reply_s
    lag = percentiles(merged.input_lag_ms)
    realtime = merged.underruns == 0 and (lag["p95"] or 0.0) < 200.0
    busy = engine.stats.busy_s - busy_before
    busy_cpu = engine.stats.busy_cpu_s - cpu_before
    steps = engine.stats.steps - steps_before
    stages = engine.stats.summary()
    frames = stages.get("codec", {}).get("items", 0)
    # On a GPU the stage timers are the device's (duplex.engine.timing), and the engine
    # thread's CPU time includes its waits for the device: what the GPU was busy with is the
    # stages' sum, and a CPU share would say nothing of who computed.
    gpu_s = (sum(sum(st.compute_ms) for st in engine.stats.stages.values()) / 1000
             if str(engine.model.device).startswith("cuda") else None)
    return {
        "sessions": sessions,
        "realtime": realtime,
        "underruns": merged.underruns,
        "input_lag_ms": lag,
        "stages": stages,
        "ttfa_ms": percentiles(merged.ttfa_ms),
        "barge_in_ms": percentiles(merged.barge_in_ms),
        "vad_detect_ms": percentiles(merged.vad_detect_ms),
        "pause_ms": percentiles(merged.pause_ms),
        "rtf": round(busy / max(wall, 1e-9) / max(sessions, 1), 4),
        "engine_ms_per_session_frame": round(busy * 1000 / frames, 4) if frames else None,
        "engine_cpu_ms_per_session_frame": round(busy_cpu * 1000 / frames, 4) if frames else None,
        "engine_cpu_share": round(busy_cpu / busy, 3) if busy and gpu_s is None else None,
        "engine_gpu_ms_per_session_frame": (round(gpu_s * 1000 / frames, 4)
                                            if gpu_s is not None and frames else None),
        "engine_gpu_share": round(gpu_s / busy, 3) if gpu_s is not None and busy else None,
        "engine_steps": steps,
        "engine_ms_per_step": round(busy * 1000 / steps, 3) if steps else None,
        "rss_mb": _rss_mb(engine),
        "bytes_held_per_session": int(np.mean(held)) if held else 0,
        "bytes_held_after_close": left,
        "reply_audio_s": round(merged.reply_s, 2),
        "kv": kv_peak.peak,
    }


async def find_max(engine, vad, duration_s: float, limit: int, log, label: str,
                   arrivals: str = "herd", seed: int = 0) -> tuple[int, dict]:
    """Largest N that stays real time: doubling, then bisection."""
    best, best_result = 0, None
    n, hi = 1, None
    while True:
        result = await run_mode(engine, vad, n, duration_s, arrivals, seed)
        log(f"  {label} N={n}: realtime={result['realtime']} "
            f"underruns={result['underruns']} lag_p95={result['input_lag_ms']['p95']}")
        if result["realtime"]:
            best, best_result = n, result
            if hi is None:
                if n >= limit:
                    break
                n = min(n * 2, limit)
                continue
        else:
            hi = n
        if hi is not None and hi - best <= 1:
            break
        n = (best + hi) // 2 if hi is not None else n
    return best, best_result


def measure_ceiling(engine, stages: dict) -> dict:
    """The model-alone ceiling at the batch sizes of the run whose stage summary is `stages`,
    measured where the model lives while the engine is idle."""
    loads = ceiling.stage_loads(stages)
    if not loads:
        return ceiling.ceiling({}, {"frame_ms": 0.0, "ms_per_call": {}})
    engine.wait_idle()
    measured = engine.query(partial(ceiling.measure,
                                    batches={name: load.batch for name, load in loads.items()}))
    return ceiling.ceiling(loads, measured, stages)


def bench(model_name: str, cache_dir: str, sessions: int, duration_s: float, baseline: bool,
          find: bool, limit: int, log=print, torch_threads: int = 0,
          scheduler: dict | None = None, in_process: bool = False, dtype: str = "auto",
          cuda_graphs: bool = False, arrivals: str = "herd", seed: int = 0,
          pin_cpus: bool = False, batched_only: bool = False, kv_memory: float = 0.0,
          kv_sessions: int = MIXED_SESSIONS, rounds: int = 1) -> dict:
    """`scheduler` overrides SchedulerConfig fields and `in_process` keeps the engine on a
    thread (engine.process = false): the engine settings the server uses. `dtype`,
    `cuda_graphs`, `pin_cpus` and `kv_memory` as model.dtype and engine.cuda_graphs,
    engine.pin_cpus and engine.kv_memory. `arrivals` and `seed` say when sessions start and
    how they talk (arrivals.py). `batched_only` leaves out the per-session mode that `find`
    and `baseline` add: one model build, no ratio. `kv_sessions`: sessions of mixed context
    lengths the KV figures are also taken at (kv.py; 0: not measured). `rounds`: each mode's
    run and its ceiling, that many times on one build; a mode reports its median round
    (`_median`)."""
    vad = VadService()
    # A GPU host may carry no livekit: the bench's callers never echo, so no canceller starts.
    if importlib.util.find_spec("livekit") is not None:
        echo_guard_warm_up()
    modes: dict[str, dict] = {}
    maxima: dict[str, int] = {}
    codec_ratio = kv_mixed = None
    model_name_seen = device = dtype_seen = None
    startup: dict = {}
    try:
        both = (find or baseline) and not batched_only
        wanted = (("batched", True), ("baseline", False)) if both else (("batched", True),)
        for mode, batching in wanted:
            spec = ChildSpec(
                model_name, cache_dir, "auto",
                # The bench measures past the admission limit, so it never refuses a session.
                EngineConfig(max_sessions=max(limit, sessions), max_load=math.inf,
                             batching=batching, scheduler=SchedulerConfig(**(scheduler or {}))),
                torch_threads,
                dtype=dtype,
                cuda_graphs=cuda_graphs,
                pin_cpus=pin_cpus,
                kv_memory=kv_memory,
            )
            engine = start_engine(spec, in_process)
            try:
                model = engine.model
                model_name_seen, device, dtype_seen = model.name, model.device, model.dtype
                startup = model.startup
                runs = []
                for k in range(rounds):
                    label = mode if rounds == 1 else f"{mode} round {k + 1}"
                    runs.append(_round(engine, vad, find, sessions, duration_s, limit, log,
                                       label, arrivals, seed))
                modes[mode] = result = _median(runs, find)
                if find:
                    maxima[mode] = result["max_realtime_sessions"]
                # The model's caches since the engine started (models.caches), measured apart.
                result["caches"] = {name: asdict(s) for name, s in engine.cache_stats.items()}
                # The decode steps since the engine started, by how they ran (graph replays).
                result["graphs"] = engine.graph_stats
                if codec_ratio is None:
                    codec_ratio = engine.query(stream_vs_offline)
                if kv_sessions and kv_mixed is None:
                    kv_mixed = engine.query(partial(mixed_contexts, sessions=kv_sessions))
            finally:
                engine.stop()
    finally:
        vad.stop()
    ratio = None
    if "baseline" in modes and find:
        ratio = round(maxima["batched"] / maxima["baseline"], 2) if maxima["baseline"] else None
    elif "baseline" in modes:
        b, s = modes["batched"]["rtf"], modes["baseline"]["rtf"]
        ratio = round(s / b, 2) if b else None
    for result in modes.values():
        result["codec_stream_vs_offline"] = codec_ratio
        result["kv_mixed"] = kv_mixed
    return {
        "model": model_name_seen,
        "device": device,
        "startup": startup,
        "dtype": dtype_seen,
        "cuda_graphs": cuda_graphs,
        "torch_threads": resolve_torch_threads(torch_threads),
        "engine": "thread" if in_process else "process",
        "duration_s": duration_s,
        "arrivals": arrivals,
        "seed": seed,
        "modes": modes,
        "ratio": ratio,
    }


def _round(engine, vad, find: bool, sessions: int, duration_s: float, limit: int, log,
           label: str, arrivals: str, seed: int) -> dict:
    """One run (the largest real-time count with `find`, else `sessions`) and its ceiling."""
    if find:
        n, result = asyncio.run(find_max(engine, vad, duration_s, limit, log, label,
                                         arrivals, seed))
        result = result or asyncio.run(run_mode(engine, vad, 1, duration_s, arrivals, seed))
        result["max_realtime_sessions"] = n
    else:
        result = asyncio.run(run_mode(engine, vad, sessions, duration_s, arrivals, seed))
    result.update(measure_ceiling(engine, result["stages"]))
    if find:
        cap = result["ceiling_sessions"]
        result["efficiency"] = round(result["max_realtime_sessions"] / cap, 3) if cap else None
    return result


def _median(runs: list[dict], find: bool) -> dict:
    """The median round of a mode (by efficiency with `find`, else by rtf), with every round's
    figures beside it and, for more than one, the median and the range of each."""
    key = "efficiency" if find else "rtf"
    ranked = sorted(runs, key=lambda r: r.get(key) or 0.0)
    result = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) == 1:
        return result
    figures = ("max_realtime_sessions", "ceiling_sessions", "efficiency") if find else (
        "rtf", "ceiling_sessions")
    result["rounds"] = [{f: r.get(f) for f in figures} for r in runs]
    for f in figures:
        values = [r[f] for r in runs if r.get(f) is not None]
        if values:
            result[f] = round(statistics.median(values), 3)
            result[f"{f}_range"] = [min(values), max(values)]
    return result


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _kv_cells(figures: dict | None) -> str:
    if not figures:
        return "-"
    mb = [figures[k] / 2**20 for k in ("allocated_bytes", "slot_pool_bytes", "needed_bytes")]
    return " / ".join(f"{v:.1f}" for v in mb)


def _steps_cells(paths: dict | None) -> str:
    if not paths:
        return "-"
    return " / ".join(str(paths.get(p, 0)) for p in ("replays", "static", "eager"))


def _mixed_label(report: dict) -> str:
    mixed = next(iter(report["modes"].values())).get("kv_mixed")
    if not mixed:
        return "mixed contexts"
    low, high = mixed["context_positions"]
    return f"{mixed['sessions']} sessions of {low}-{high} positions"


def _spread(mode: dict, figure: str) -> str:
    """`low-high (n rounds)` of a figure measured in several rounds."""
    span = mode.get(f"{figure}_range")
    if not span:
        return "-"
    return f"{_num(span[0])}-{_num(span[1])} ({len(mode['rounds'])})"


def table(report: dict) -> str:
    rows = [("", *report["modes"].keys())]

    def row(label, fn):
        rows.append((label, *(fn(m) for m in report["modes"].values())))

    def pq(d):
        return "-" if d["p50"] is None else f"{d['p50']:.0f} / {d['p95']:.0f}"

    def pqn(d):
        return "-" if d["p50"] is None else f"{pq(d)} ({d['n']})"

    row("sessions", lambda m: str(m["sessions"]))
    row("max realtime sessions", lambda m: str(m.get("max_realtime_sessions", "-")))
    row("realtime", lambda m: str(m["realtime"]))
    row("underruns", lambda m: str(m["underruns"]))
    row("input lag ms p50/p95", lambda m: pq(m["input_lag_ms"]))
    row("ttfa ms p50/p95 (n)", lambda m: pqn(m["ttfa_ms"]))
    row("barge-in ms p50/p95 (n)", lambda m: pqn(m["barge_in_ms"]))
    row("vad detect ms p50/p95 (n)", lambda m: pqn(m["vad_detect_ms"]))
    row("pause ms p50/p95 (n)", lambda m: pqn(m["pause_ms"]))
    row("rtf (busy/wall/session)", lambda m: f"{m['rtf']:.4f}")
    row("engine ms / step", lambda m: _num(m["engine_ms_per_step"]))
    row("engine ms / session frame", lambda m: _num(m["engine_ms_per_session_frame"]))
    row("engine CPU ms / session frame", lambda m: _num(m["engine_cpu_ms_per_session_frame"]))
    row("engine CPU share of busy", lambda m: _num(m["engine_cpu_share"]))
    row("engine GPU ms / session frame", lambda m: _num(m["engine_gpu_ms_per_session_frame"]))
    row("engine GPU share of busy", lambda m: _num(m["engine_gpu_share"]))
    row("ceiling ms / session frame", lambda m: _num(m["ceiling_ms_per_session_frame"]))
    row("ceiling sessions", lambda m: _num(m["ceiling_sessions"]))
    row("efficiency (max / ceiling)", lambda m: _num(m.get("efficiency")))
    row("efficiency range (rounds)", lambda m: _spread(m, "efficiency"))
    row("max sessions range (rounds)", lambda m: _spread(m, "max_realtime_sessions"))
    row("rss MB", lambda m: f"{m['rss_mb']:.0f}")
    row("bytes held / session", lambda m: str(m["bytes_held_per_session"]))
    row("bytes held after close", lambda m: str(m["bytes_held_after_close"]))
    for kv_stage in sorted({s for m in report["modes"].values() for s in m["kv"]}):
        row(f"kv {kv_stage} at peak: paged / slots / needed MiB",
            lambda m, st=kv_stage: _kv_cells(m["kv"].get(st)))
        row(f"kv {kv_stage} at {_mixed_label(report)}: paged / slots / needed MiB",
            lambda m, st=kv_stage: _kv_cells((m["kv_mixed"] or {}).get("kv", {}).get(st)))
    for stage in sorted({s for m in report["modes"].values() for s in m.get("graphs", {})}):
        row(f"{stage} steps: replays / static / eager",
            lambda m, st=stage: _steps_cells(m.get("graphs", {}).get(st)))
    stages = sorted({s for m in report["modes"].values() for s in m["stages"]})
    for st in stages:
        row(f"{st}: compute ms p50/p95", lambda m, st=st: pq(m["stages"][st]["compute_ms"]) if st in m["stages"] else "-")
        row(f"{st}: queue ms p50/p95", lambda m, st=st: pq(m["stages"][st]["queue_ms"]) if st in m["stages"] else "-")
        row(f"{st}: mean batch", lambda m, st=st: str(m["stages"][st]["mean_batch"]) if st in m["stages"] else "-")
        row(f"{st}: engine / ceiling ms per frame",
            lambda m, st=st: _num(m.get("ceiling_stages", {}).get(st, {}).get("engine_vs_ceiling")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        f"model {report['model']} on {report['device']} in {report['dtype']} "
        f"({report['torch_threads']} torch threads, engine in a {report['engine']}; "
        f"{report['arrivals']} arrivals, seed {report['seed']}); "
        f"ratio batched/baseline: {report['ratio']}"
    )
    startup = report.get("startup") or {}
    if startup:
        parts = [f"{k}: {v}" for k, v in startup.items() if k != "warnings"]
        parts += [f"WARNING {w}" for w in startup.get("warnings", ())]
        lines.append("model startup: " + "; ".join(parts))
    codec = next(iter(report["modes"].values()))["codec_stream_vs_offline"]
    if codec:
        lines.append(f"codec streaming vs offline cost per frame: {codec}")
    return "\n".join(lines)
