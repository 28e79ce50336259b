"""`duplex bench --mode duplex`: always-on native duplex sessions against the lockstep engine.

Every session sends one model frame (80 ms) of its own audio on its own clock: speech, then
silence, in turns of random length, so the model's voice overlaps the user's some of the time.
Session clocks start spread over a frame, as real callers' do, and the engine's ticks gather
them. Reported: the largest session count that stays real time (`--find-max`: no frame dropped,
tick p95 and output lateness p95 within the frame), tick time p50/p95/p99 against the frame
budget, per-stage compute and batch size, lateness of output frames, frames dropped; and the
same with one model step per session per tick (`--baseline per-session`).

`--long-call STEPS` drives one session for STEPS frames with no real-time clock (the engine's
lockstep on a simulated clock) and reports the bytes it holds along the way: flat once the
model's windows have filled, however long the call.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import numpy as np

from duplex.bench.synth import babble
from duplex.engine import ChildSpec, EngineConfig, start_engine
from duplex.engine.lockstep import DuplexDropped, DuplexOut, Lockstep
from duplex.engine.stats import EngineStats
from models.base import DuplexModel

STAGES = ("duplex_tick", "duplex_encode", "duplex_main", "duplex_depth", "duplex_decode",
          "duplex_echo")


def pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64)
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 95, 99)}


def conversation(seed: int, frames: int, frame: int, rate: int) -> np.ndarray:
    """A caller's audio: turns of speech (0.8-2.5 s) and silence (0.4-1.5 s)."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < frames * frame:
        talk = int(rate * rng.uniform(0.8, 2.5))
        quiet = int(rate * rng.uniform(0.4, 1.5))
        out += [babble(talk, rate, seed=int(rng.integers(1 << 30))), np.zeros(quiet, np.float32)]
        total += talk + quiet
    return np.concatenate(out)[: frames * frame]


class _Listener:
    def __init__(self) -> None:
        self.late_ms: list[float] = []
        self.frames = 0
        self.voiced = 0
        self.dropped = 0
        self.lock = threading.Lock()

    def __call__(self, event) -> None:
        with self.lock:
            if isinstance(event, DuplexOut):
                self.frames += 1
                self.voiced += event.voiced
                self.late_ms.append(event.late_ms)
            elif isinstance(event, DuplexDropped):
                self.dropped += event.n_samples


def run_load(engine, sessions: int, duration_s: float) -> dict:
    """`sessions` duplex sessions for `duration_s`, each sending a frame every frame period."""
    info = engine.model
    frame, rate = info.input_chunk_samples, info.input_rate
    frame_s = frame / rate
    n_frames = max(1, int(duration_s / frame_s))
    engine.wait_idle()
    engine.stats.take()
    engine.drain_drops()
    listener = _Listener()
    audio = [conversation(i, n_frames, frame, rate) for i in range(sessions)]
    ids = [f"bench_{i}_{time.monotonic_ns()}" for i in range(sessions)]
    for sid in ids:
        engine.open(sid, listener)
        engine.set_duplex(sid, True)
    offsets = [frame_s * i / sessions for i in range(sessions)]
    sends = sorted((k * frame_s + offsets[i], i, k) for i in range(sessions)
                   for k in range(n_frames))
    t0 = time.monotonic() + 0.05
    for at, i, k in sends:
        wait = t0 + at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        engine.push_audio(ids[i], audio[i][k * frame : (k + 1) * frame])
    deadline = time.monotonic() + 10 + duration_s
    while time.monotonic() < deadline:
        with listener.lock:
            if listener.frames + listener.dropped // frame >= sessions * n_frames:
                break
        time.sleep(0.02)
    for sid in ids:
        engine.close(sid)
    engine.wait_idle()
    taken = engine.stats.take()
    drops = [d for d in engine.drain_drops() if d.kind == "duplex_frame" and d.reason == "behind"]
    tick = taken.get("duplex_tick", ([], [], []))
    stages = {}
    for name in STAGES[1:]:
        if name in taken:
            _, compute, batch = taken[name]
            stages[name.removeprefix("duplex_")] = {
                "compute_ms": pct(compute),
                "mean_batch": round(float(np.mean(batch)), 3) if batch else None,
                "calls": len(batch),
            }
    frame_ms = 1000 * frame_s
    ticks, late = pct(tick[1]), pct(listener.late_ms)
    dropped = sum(d.n for d in drops)
    realtime = (dropped == 0 and ticks["p95"] is not None and ticks["p95"] <= frame_ms
                and late["p95"] is not None and late["p95"] <= frame_ms)
    return {
        "sessions": sessions,
        "frame_ms": round(frame_ms, 3),
        "frames_in": sessions * n_frames,
        "frames_out": listener.frames,
        "voiced_share": round(listener.voiced / max(1, listener.frames), 3),
        "frames_dropped": dropped,
        "tick_ms": ticks,
        "tick_sessions_mean": round(float(np.mean(tick[2])), 3) if tick[2] else None,
        "late_ms": late,
        "stages": stages,
        "realtime": realtime,
    }


def find_max(engine, duration_s: float, limit: int, log) -> tuple[int, dict | None]:
    """The largest N that runs real time: doubling, then bisecting."""
    good, good_result, bad = 0, None, None
    n = 1
    while n <= limit:
        result = run_load(engine, n, duration_s)
        log(f"  {n} sessions: tick p95 {result['tick_ms']['p95']} ms, late p95 "
            f"{result['late_ms']['p95']} ms, dropped {result['frames_dropped']}"
            f" -> {'real time' if result['realtime'] else 'behind'}")
        if not result["realtime"]:
            bad = n
            break
        good, good_result = n, result
        n *= 2
    hi = bad if bad is not None else limit + 1
    while hi - good > 1:
        mid = (good + hi) // 2
        result = run_load(engine, mid, duration_s)
        log(f"  {mid} sessions: -> {'real time' if result['realtime'] else 'behind'}")
        if result["realtime"]:
            good, good_result = mid, result
        else:
            hi = mid
    return good, good_result


def bench(model_name: str, cache_dir: str, *, sessions: int, duration_s: float, baseline: bool,
          find: bool, limit: int, log: Callable[[str], None], torch_threads: int,
          max_lag_ms: int, in_process: bool, pin_cpus: bool = False) -> dict:
    modes: dict[str, dict] = {}
    model_seen = device = None
    for mode, batching in [("batched", True)] + ([("per_session", False)] if baseline else []):
        log(f"duplex bench: {mode}")
        spec = ChildSpec(model_name, cache_dir, "auto", EngineConfig(
            max_sessions=max(limit, sessions) + 1, max_load=math.inf, batching=batching,
            duplex_max_lag_ms=max_lag_ms), torch_threads, pin_cpus=pin_cpus)
        engine = start_engine(spec, in_process)
        try:
            if engine.model.duplex_delay_frames is None:
                raise SystemExit(f"duplex bench: model {engine.model.name} has no duplex mode")
            model_seen, device = engine.model.name, engine.model.device
            # First calls allocate and pick kernels: a short run first, not counted.
            run_load(engine, 2, min(2.0, duration_s))
            if find:
                n, result = find_max(engine, duration_s, limit, log)
                result = result or run_load(engine, 1, duration_s)
                result["max_realtime_sessions"] = n
            else:
                result = run_load(engine, sessions, duration_s)
            modes[mode] = result
        finally:
            engine.stop()
    report = {"mode": "duplex", "model": model_seen, "device": device,
              "duration_s": duration_s, "max_lag_ms": max_lag_ms, "modes": modes}
    if find and baseline:
        b, s = (modes[m]["max_realtime_sessions"] for m in ("batched", "per_session"))
        report["max_sessions_ratio"] = round(b / s, 2) if s else None
    return report


def table(report: dict) -> str:
    modes = report["modes"]
    rows = [("", *modes)]

    def add(label: str, fn) -> None:
        rows.append((label, *(str(fn(m)) for m in modes.values())))

    if "max_realtime_sessions" in next(iter(modes.values())):
        add("max real-time sessions", lambda m: m["max_realtime_sessions"])
    add("sessions", lambda m: m["sessions"])
    add("frame budget ms", lambda m: m["frame_ms"])
    for q in ("p50", "p95", "p99"):
        add(f"tick ms {q}", lambda m, q=q: m["tick_ms"][q])
    add("sessions per tick", lambda m: m["tick_sessions_mean"])
    for q in ("p50", "p95", "p99"):
        add(f"output late ms {q}", lambda m, q=q: m["late_ms"][q])
    add("frames dropped", lambda m: m["frames_dropped"])
    add("voiced share", lambda m: m["voiced_share"])
    stages = sorted({s for m in modes.values() for s in m["stages"]})
    for s in stages:
        add(f"{s} ms p50 (batch)", lambda m, s=s: (
            f"{m['stages'][s]['compute_ms']['p50']} ({m['stages'][s]['mean_batch']})"
            if s in m["stages"] else "-"))
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = [f"duplex bench: model {report['model']} on {report['device']}, "
             f"{report['duration_s']:g} s per run, max lag {report['max_lag_ms']} ms"]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    if "max_sessions_ratio" in report:
        lines.append(f"batched / per-session max sessions: {report['max_sessions_ratio']}")
    return "\n".join(lines)


def long_call(model: DuplexModel, steps: int, samples: int = 20, seed: int = 0) -> dict:
    """One session for `steps` frames on a simulated clock: what it holds along the way."""
    stats = EngineStats()
    lockstep = Lockstep(model, max_lag_ms=1000, stats=stats)
    state = model.new_state("long")
    lockstep.join("long", 0, 0)
    frame, frame_s = model.input_chunk_samples, model.input_chunk_samples / model.input_rate
    rng = np.random.default_rng(seed)
    voice = [0.3 * rng.standard_normal(frame).astype(np.float32) for _ in range(16)]
    quiet = np.zeros(frame, np.float32)
    every = max(1, steps // samples)
    held: list[tuple[int, int]] = []
    outputs = 0
    start = time.monotonic()
    for k in range(steps):
        now = k * frame_s
        # Two seconds of speech, then two of silence: the model hears both, all call long.
        lockstep.push("long", voice[k % 16] if (k // 25) % 2 == 0 else quiet, now)
        # The tick comes a little after the frame, as on a real clock (never quite on it).
        ticked = lockstep.step({"long": state}, now + frame_s / 4)
        outputs += sum(isinstance(e, DuplexOut) for e in ticked)
        stats.take()
        if (k + 1) % every == 0:
            held.append((k + 1, model.bytes_held(state) + lockstep.queued_bytes("long")))
    elapsed = time.monotonic() - start
    model.free(state)
    return {"steps": steps, "outputs": outputs, "call_minutes": round(steps * frame_s / 60, 1),
            "wall_s": round(elapsed, 1), "bytes_held": held,
            "bytes_max": max(b for _, b in held), "bytes_last": held[-1][1],
            "freed": model.bytes_held(state) == 0}


def run_cli(args, settings, model_name: str) -> int:
    """`duplex bench --mode duplex ...` as the CLI parsed it; prints the table (and JSON)."""
    import sys

    from duplex.bench import show

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.long_call:
        from duplex.engine import set_torch_threads
        from models.registry import load_model

        set_torch_threads(settings.engine.torch_threads)
        report = long_call(load_model(model_name, settings.model.cache_dir), args.long_call)
        text = (f"long call: {report['steps']} steps ({report['call_minutes']} min of audio) in "
                f"{report['wall_s']} s; bytes held max {report['bytes_max']}, last "
                f"{report['bytes_last']}; freed on close: {report['freed']}")
    else:
        report = bench(model_name, settings.model.cache_dir, sessions=args.sessions,
                       duration_s=args.duration, baseline=args.baseline == "per-session",
                       find=args.find_max, limit=args.max_sessions, log=log,
                       torch_threads=settings.engine.torch_threads,
                       max_lag_ms=settings.duplex.max_lag_ms,
                       in_process=not settings.engine.process,
                       pin_cpus=settings.engine.pin_cpus)
        text = table(report)
    show(text, report, args.json)
    return 0
