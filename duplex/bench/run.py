"""Paced synthetic sessions in-process: the same Realtime session loop, engine and VAD as the
server, driven by scripted clients that speak, wait, and talk over replies.

Each client streams 20 ms frames at real time. Its script alternates a plain turn (speak, then
listen to the whole reply) with a barge-in turn (speak again shortly after the reply starts).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np

from duplex.bench.synth import babble
from duplex.engine import Engine, EngineConfig, SchedulerConfig, set_torch_threads
from duplex.engine.stats import percentiles
from duplex.media import float_to_pcm16
from duplex.transport.realtime.protocol import Limits
from duplex.transport.realtime.ws import RealtimeSession
from duplex.vad import VadService

RATE = 24000
FRAME = RATE // 50


@dataclass
class ClientRecord:
    ttfa_ms: list[float] = field(default_factory=list)
    vad_detect_ms: list[float] = field(default_factory=list)
    barge_in_ms: list[float] = field(default_factory=list)
    input_lag_ms: list[float] = field(default_factory=list)
    underruns: int = 0
    reply_s: float = 0.0


class ScriptedClient:
    def __init__(self, index: int, session: RealtimeSession, duration_s: float) -> None:
        self.index = index
        self.session = session
        self.duration_s = duration_s
        self.rng = random.Random(index)
        self.rec = ClientRecord()
        self.speech_onsets: list[float] = []
        self.speech_end: float | None = None
        self.awaiting_first_audio = False
        self.reply_start: float | None = None
        self.reply_audio_s = 0.0
        self.response_id: str | None = None
        self.last_delta_at: dict[str, float] = {}
        self.barge_decision: dict[str, float] = {}
        self.responses_done = asyncio.Event()

    async def on_event(self, text: str) -> None:
        now = time.monotonic()
        event = json.loads(text)
        kind = event["type"]
        if kind == "input_audio_buffer.speech_started" and self.speech_onsets:
            self.rec.vad_detect_ms.append((now - self.speech_onsets.pop(0)) * 1000)
            if self.response_id is not None:
                self.barge_decision[self.response_id] = now
        elif kind == "response.created":
            self.response_id = event["response"]["id"]
            self.reply_start = None
            self.reply_audio_s = 0.0
            self.responses_done.clear()
        elif kind == "response.output_audio.delta":
            rid = event["response_id"]
            self.last_delta_at[rid] = now
            seconds = len(base64.b64decode(event["delta"])) / 2 / RATE
            if self.reply_start is None:
                self.reply_start = now
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

    async def _send_frames(self, frames: np.ndarray, t_start: float) -> float:
        """Stream frames at real time from t_start; returns when the last one is due."""
        for i in range(0, len(frames), FRAME):
            due = t_start + i / RATE
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            self.rec.input_lag_ms.append(max(0.0, time.monotonic() - due) * 1000)
            chunk = float_to_pcm16(frames[i : i + FRAME])
            self.session.feed_text(json.dumps({
                "type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode(),
            }))
        return t_start + len(frames) / RATE

    async def run(self) -> None:
        t = time.monotonic() + self.rng.uniform(0, 1.0)
        end = time.monotonic() + self.duration_s
        silence = np.zeros(FRAME, np.float32)
        turn = 0
        while time.monotonic() < end:
            speech = babble(int(RATE * self.rng.uniform(1.0, 2.0)), seed=self.index * 1000 + turn)
            self.speech_onsets.append(t)
            t = await self._send_frames(speech, t)
            self.speech_end = t
            self.awaiting_first_audio = True
            barge = turn % 2 == 1
            listen_until = None
            # Keep streaming silence (the microphone stays open) while the reply plays.
            while time.monotonic() < end:
                t = await self._send_frames(silence, t)
                if self.reply_start is not None and listen_until is None:
                    listen_until = t + (self.rng.uniform(0.4, 0.8) if barge else 1e9)
                if listen_until is not None and t >= listen_until:
                    break
                if listen_until is not None and not barge and self.response_id is None:
                    t = await self._send_frames(np.zeros(RATE // 2, np.float32), t)
                    break
                if self.reply_start is None and t - self.speech_end > 5.0:
                    break
            turn += 1


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


async def run_mode(model, vad: VadService, sessions: int, duration_s: float, batching: bool,
                   scheduler: dict | None = None) -> dict:
    engine = Engine(
        model,
        EngineConfig(
            max_sessions=max(sessions, 1),
            max_load=1.0,
            batching=batching,
            scheduler=SchedulerConfig(output_rate=model.output_rate, **(scheduler or {})),
        ),
    )
    engine.start()
    clients: list[ScriptedClient] = []
    runners = []
    started = time.monotonic()
    try:
        for i in range(sessions):
            holder: dict[str, ScriptedClient] = {}

            async def send_text(text: str, holder=holder) -> None:
                await holder["client"].on_event(text)

            session = RealtimeSession(engine, vad, Limits(), model.name, send_text,
                                      session_id=f"bench_{i}")
            session.open()
            client = ScriptedClient(i, session, duration_s)
            holder["client"] = client
            clients.append(client)
            runners.append(asyncio.create_task(session.run()))
        await asyncio.gather(*(c.run() for c in clients))
        held = [engine.bytes_held(c.session.session_id) for c in clients]
    finally:
        for c in clients:
            c.session.carrier_gone()
        await asyncio.gather(*runners, return_exceptions=True)
        engine.wait_idle()
        left = sum(engine.bytes_held(c.session.session_id) for c in clients)
        engine.stop()
    wall = time.monotonic() - started
    merged = ClientRecord()
    for c in clients:
        for name in ("ttfa_ms", "vad_detect_ms", "barge_in_ms", "input_lag_ms"):
            getattr(merged, name).extend(getattr(c.rec, name))
        merged.underruns += c.rec.underruns
        merged.reply_s += c.rec.reply_s
    lag = percentiles(merged.input_lag_ms)
    realtime = merged.underruns == 0 and (lag["p95"] or 0.0) < 200.0
    return {
        "sessions": sessions,
        "realtime": realtime,
        "underruns": merged.underruns,
        "input_lag_ms": lag,
        "stages": engine.stats.summary(),
        "ttfa_ms": percentiles(merged.ttfa_ms),
        "barge_in_ms": percentiles(merged.barge_in_ms),
        "vad_detect_ms": percentiles(merged.vad_detect_ms),
        "rtf": round(engine.stats.busy_s / max(wall, 1e-9) / max(sessions, 1), 4),
        "rss_mb": _rss_mb(),
        "bytes_held_per_session": int(np.mean(held)) if held else 0,
        "bytes_held_after_close": left,
        "reply_audio_s": round(merged.reply_s, 2),
    }


async def find_max(model, vad, duration_s: float, batching: bool, limit: int, log,
                   scheduler: dict | None = None) -> tuple[int, dict]:
    """Largest N that stays real time: doubling, then bisection."""
    best, best_result = 0, None
    n, hi = 1, None
    while True:
        result = await run_mode(model, vad, n, duration_s, batching, scheduler)
        log(f"  {'batched' if batching else 'baseline'} N={n}: realtime={result['realtime']} "
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


def bench(model_name: str, cache_dir: str, sessions: int, duration_s: float, baseline: bool,
          find: bool, limit: int, log=print, torch_threads: int = 0,
          scheduler: dict | None = None) -> dict:
    """`scheduler` overrides SchedulerConfig fields (the engine settings the server uses)."""
    from models.registry import load_model

    threads = set_torch_threads(torch_threads)
    model = load_model(model_name, cache_dir)
    vad = VadService()
    try:
        modes: dict[str, dict] = {}
        ratio = None
        if find:
            maxima = {}
            for mode, batching in (("batched", True), ("baseline", False)):
                n, result = asyncio.run(find_max(model, vad, duration_s, batching, limit, log, scheduler))
                result = result or asyncio.run(run_mode(model, vad, 1, duration_s, batching, scheduler))
                result["max_realtime_sessions"] = n
                modes[mode] = result
                maxima[mode] = n
            ratio = round(maxima["batched"] / maxima["baseline"], 2) if maxima["baseline"] else None
        else:
            modes["batched"] = asyncio.run(run_mode(model, vad, sessions, duration_s, True, scheduler))
            if baseline:
                modes["baseline"] = asyncio.run(run_mode(model, vad, sessions, duration_s, False, scheduler))
                b, s = modes["batched"]["rtf"], modes["baseline"]["rtf"]
                ratio = round(s / b, 2) if b else None
        codec = getattr(model, "codec_stream_vs_offline", None)
        codec_ratio = codec() if callable(codec) else None
        for result in modes.values():
            result["codec_stream_vs_offline"] = codec_ratio
        return {
            "model": model.name,
            "device": model.device,
            "torch_threads": threads,
            "duration_s": duration_s,
            "modes": modes,
            "ratio": ratio,
        }
    finally:
        vad.stop()


def table(report: dict) -> str:
    rows = [("", *report["modes"].keys())]

    def row(label, fn):
        rows.append((label, *(fn(m) for m in report["modes"].values())))

    def pq(d):
        return "-" if d["p50"] is None else f"{d['p50']:.0f} / {d['p95']:.0f}"

    row("sessions", lambda m: str(m["sessions"]))
    row("max realtime sessions", lambda m: str(m.get("max_realtime_sessions", "-")))
    row("realtime", lambda m: str(m["realtime"]))
    row("underruns", lambda m: str(m["underruns"]))
    row("input lag ms p50/p95", lambda m: pq(m["input_lag_ms"]))
    row("ttfa ms p50/p95", lambda m: pq(m["ttfa_ms"]))
    row("barge-in ms p50/p95", lambda m: pq(m["barge_in_ms"]))
    row("vad detect ms p50/p95", lambda m: pq(m["vad_detect_ms"]))
    row("rtf (busy/wall/session)", lambda m: f"{m['rtf']:.4f}")
    row("rss MB", lambda m: f"{m['rss_mb']:.0f}")
    row("bytes held / session", lambda m: str(m["bytes_held_per_session"]))
    row("bytes held after close", lambda m: str(m["bytes_held_after_close"]))
    stages = sorted({s for m in report["modes"].values() for s in m["stages"]})
    for st in stages:
        row(f"{st}: compute ms p50/p95", lambda m, st=st: pq(m["stages"][st]["compute_ms"]) if st in m["stages"] else "-")
        row(f"{st}: queue ms p50/p95", lambda m, st=st: pq(m["stages"][st]["queue_ms"]) if st in m["stages"] else "-")
        row(f"{st}: mean batch", lambda m, st=st: str(m["stages"][st]["mean_batch"]) if st in m["stages"] else "-")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        f"model {report['model']} on {report['device']} ({report['torch_threads']} torch threads); "
        f"ratio batched/baseline: {report['ratio']}"
    )
    codec = next(iter(report["modes"].values()))["codec_stream_vs_offline"]
    if codec:
        lines.append(f"codec streaming vs offline cost per frame: {codec}")
    return "\n".join(lines)
