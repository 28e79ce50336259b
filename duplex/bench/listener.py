"""`duplex bench --listener`: how long a listener goes on hearing a reply after talking over it,
measured where it is heard, on each transport.

Each session is a caller (duplex.bench.peers) that says one of the bench's recordings, waits
for the reply to play 0.4-0.8 s, and talks over it: in turn a cough (a 150 ms voiced burst, which
pauses the reply and should let it resume) and a sentence (which cuts it and is the next turn).
Figures, per transport: from the first sample of the interrupting sound to the last sample of
the reply the listener played (`stop_ms`); for WebRTC also net of the peer's own receive path
(from the server's track sending a frame to the peer playing it: aiortc's jitter buffer, the
codec and the peer's playout, measured frame by frame in the same run); when the pause
reached the peer; whether a coughed-over reply resumed and was heard whole. Every transport's
sessions run in turn against one engine, in this process, in real time.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, replace

import numpy as np

from duplex.bench.peers import Peer, RealtimePeer, TwilioPeer, WebRTCPeer
from duplex.bench.speech import utterances
from duplex.engine import ChildSpec, EngineConfig, SchedulerConfig, start_engine
from duplex.engine.stats import percentiles
from duplex.engine.vad import VadService
from duplex.media.echo import warm_up as echo_guard_warm_up
from duplex.observability.metrics import Metrics
from duplex.transport.hub import SessionHub
from duplex.transport.realtime.protocol import Limits
from duplex.transport.twilio.protocol import Options
from duplex.transport.webrtc.calls import CallRegistry

TRANSPORTS = ("twilio", "webrtc", "websocket", "websocket_paused")
"""websocket_paused: a WebSocket client that also pauses its playout at duplex.output.paused."""
COUGH_S = 0.15
REPLY_WAIT_S = 8.0
"""A turn whose reply has not begun playing by then is given up and the caller speaks again."""
QUIET_AFTER_S = 1.5
"""A coughed-over reply that has played nothing for this long has ended."""
POLL_S = 0.02


@dataclass(frozen=True)
class Barge:
    kind: str
    """cough | speech"""
    onset: int
    """The sound's first sample, on the peer's clock."""
    reply: object


def cough(rate: int) -> np.ndarray:
    """150 ms from the loudest stretch of a recording: a syllable, voiced, short of a word."""
    speech = utterances(rate)[2]
    n = int(COUGH_S * rate)
    energy = np.convolve(speech**2, np.ones(n), "valid")
    start = int(np.argmax(energy))
    burst = speech[start : start + n].copy()
    return burst * (0.9 / np.abs(burst).max())


async def _until(condition, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return value


def _first_new_reply(peer: Peer, after: int, seen: set) -> tuple[object, int] | None:
    """A reply not `seen` before whose audio began playing at `after` or later."""
    return next(((tag, start) for tag, start in peer.playout.first.items()
                 if tag is not None and tag not in seen and start >= after), None)


async def converse(peer: Peer, rng: random.Random, end_s: float) -> list[Barge]:
    """The caller's script until `end_s` on its clock; returns what it talked over."""
    rate = peer.rate
    said = utterances(rate)
    burst = cough(rate)
    end = int(end_s * rate)
    barges: list[Barge] = []
    seen: set = set()
    turn = 0
    at = peer.next_frame() + rng.randrange(rate)
    peer.say(said[rng.randrange(len(said))][: rng.randrange(rate, 2 * rate)], at)
    while peer.now() < end:
        found = await _until(lambda a=at: _first_new_reply(peer, a, seen), REPLY_WAIT_S)
        if not found:
            at = peer.next_frame()
            peer.say(said[rng.randrange(len(said))][: rng.randrange(rate, 2 * rate)], at)
            continue
        reply, started = found
        seen.add(reply)
        listen = started + int(rng.uniform(0.4, 0.8) * rate)
        await asyncio.sleep(max(0.0, peer.at(listen) - time.monotonic()))
        onset = peer.next_frame()
        if peer.now() >= end or not peer.playout.playing(peer.now(), reply):
            # The reply ended (or ran dry) before the caller got to it: just the next turn.
            at = onset + rate // 2
            peer.say(said[rng.randrange(len(said))][: rng.randrange(rate, 2 * rate)], at)
            continue
        if turn % 2 == 0:
            peer.say(burst, onset)
            barges.append(Barge("cough", onset, reply))
            await _until(lambda r=reply: not any(
                s.tag == r and s.end > peer.now() - QUIET_AFTER_S * rate
                for s in peer.playout.segments[-100:]), 20.0)
            at = peer.next_frame() + rate // 2
        else:
            at = onset
            barges.append(Barge("speech", onset, reply))
        peer.say(said[rng.randrange(len(said))][: rng.randrange(rate, 2 * rate)], at)
        turn += 1
    return barges


def judge(peer: Peer, barge: Barge) -> dict | None:
    """What the listener heard of the reply `barge` talked over; None if none of it was playing
    when the sound began."""
    rate, p = peer.rate, peer.playout
    if not p.playing(barge.onset, barge.reply):
        return None
    pause = next((t for t in peer.pauses if barge.onset <= t < barge.onset + 5 * rate), None)
    # What the server sent before the pause may play on; what it sent after is the resumed
    # reply. With no pause (the sound was not taken for speech), the reply played on to its
    # end, or to a break.
    stop = (p.stopped(barge.onset, barge.reply) if pause is None
            else p.last_played(barge.reply, pause))
    out = {"kind": barge.kind, "stop_ms": (stop - barge.onset) * 1000 / rate,
           "paused": pause is not None}
    if pause is not None:
        out["pause_ms"] = (pause - barge.onset) * 1000 / rate
    if isinstance(peer, WebRTCPeer):
        path = peer.path_ms(stop)
        if path is not None:
            out["net_stop_ms"] = out["stop_ms"] - path
    if barge.kind == "cough":
        length = peer.reply_length(barge.reply)
        out["resumed"] = any(s.tag == barge.reply and s.start > stop for s in p.segments)
        # Within a frame: a reply's last frame is padded (Twilio).
        out["heard_whole"] = (length is not None
                              and abs(peer.heard_samples(barge.reply) - length) <= peer.frame)
    return out


async def run_transport(transport: str, engine, vad: VadService, sessions: int,
                        duration_s: float, seed: int, settings) -> dict:
    seconds = duration_s + 40
    registry = None
    if transport == "webrtc":
        limits = replace(_limits(settings), output_lead_ms=settings.webrtc.output_lead_ms)
        registry = CallRegistry(lambda: engine, lambda: vad, limits, engine.model.name,
                                SessionHub(), settings.webrtc)
    metrics = Metrics(engine.model.name)
    peers: list[Peer] = []
    for i in range(sessions):
        name = f"listener_{transport}_{i}"
        if transport == "twilio":
            ts = settings.telephony
            options = Options(output_lead_ms=ts.output_lead_ms,
                              min_interruption_ms=ts.min_interruption_ms,
                              noise_reduction=ts.noise_reduction or None)
            peers.append(TwilioPeer(name, engine, vad, options, metrics, seconds))
        elif transport.startswith("websocket"):
            peers.append(RealtimePeer(name, engine, vad, _limits(settings), seconds,
                                      follows_pauses=transport == "websocket_paused"))
        else:
            peers.append(WebRTCPeer(registry, seconds))
    try:
        for peer in peers:
            await peer.start()
        rngs = [random.Random((seed << 32) | (TRANSPORTS.index(transport) << 16) | i)
                for i in range(sessions)]
        scripts = await asyncio.gather(*(converse(p, r, duration_s)
                                         for p, r in zip(peers, rngs, strict=True)))
        # What is still playing plays out before anything is judged.
        await asyncio.sleep(QUIET_AFTER_S)
    finally:
        for peer in peers:
            await peer.close()
    judged = [j for peer, barges in zip(peers, scripts, strict=True) for b in barges
              if (j := judge(peer, b)) is not None]
    coughs = [j for j in judged if j["kind"] == "cough"]
    report = {
        "transport": transport,
        "sessions": sessions,
        "barge_ins": len(judged),
        "stop_ms": percentiles([j["stop_ms"] for j in judged]),
        # A sound the server never took for speech (a cough silero let pass) paused nothing:
        # the reply played on to its end, which says nothing of how soon a pause stops it.
        "paused_stop_ms": percentiles([j["stop_ms"] for j in judged if j["paused"]]),
        "cough_stop_ms": percentiles([j["stop_ms"] for j in coughs]),
        "speech_stop_ms": percentiles([j["stop_ms"] for j in judged if j["kind"] == "speech"]),
        "pause_ms": percentiles([j["pause_ms"] for j in judged if "pause_ms" in j]),
        "unpaused": sum(not j["paused"] for j in judged),
        "coughs": len(coughs),
        "coughs_resumed": sum(j["resumed"] for j in coughs),
        "coughs_heard_whole": sum(j["heard_whole"] for j in coughs),
        "mic_late_ms": percentiles([x for p in peers for x in p.mic_late_ms]),
    }
    if transport == "webrtc":
        report["path_ms"] = percentiles([x for p in peers for x in p.paths_ms])
        report["receive_ms"] = percentiles([x for p in peers for x in p.receive_ms])
        report["net_stop_ms"] = percentiles([j["net_stop_ms"] for j in judged
                                             if "net_stop_ms" in j])
        report["paused_net_stop_ms"] = percentiles([j["net_stop_ms"] for j in judged
                                                    if "net_stop_ms" in j and j["paused"]])
    return report


def _limits(settings) -> Limits:
    rs = settings.realtime
    return Limits(max_message_bytes=rs.max_message_bytes, max_input_lead_ms=rs.max_input_lead_ms,
                  output_lead_ms=rs.output_lead_ms, max_errors=rs.max_errors)


def bench(model_name: str, settings, sessions: int, duration_s: float,
          transports: tuple[str, ...] = TRANSPORTS, seed: int = 0, log=print) -> dict:
    vad = VadService()
    echo_guard_warm_up()
    es = settings.engine
    spec = ChildSpec(model_name, settings.model.cache_dir, "auto",
                     EngineConfig(max_sessions=max(sessions, 1) * 2, max_load=math.inf,
                                  scheduler=SchedulerConfig(max_batch=es.max_batch,
                                                            audio_lead_s=es.audio_lead_s)),
                     es.torch_threads, dtype=settings.model.dtype, cuda_graphs=es.cuda_graphs,
                     pin_cpus=es.pin_cpus)
    engine = start_engine(spec, not es.process)
    results = {}
    try:
        for transport in transports:
            engine.wait_idle()
            log(f"  {transport}: {sessions} sessions for {duration_s:g} s")
            results[transport] = asyncio.run(
                run_transport(transport, engine, vad, sessions, duration_s, seed, settings))
        model = engine.model
        return {"model": model.name, "device": model.device, "duration_s": duration_s,
                "seed": seed, "lead_ms": {"telephony": settings.telephony.output_lead_ms,
                                          "webrtc": settings.webrtc.output_lead_ms,
                                          "realtime": settings.realtime.output_lead_ms},
                "transports": results}
    finally:
        engine.stop()
        vad.stop()


def table(report: dict) -> str:
    modes = report["transports"]
    rows = [("", *modes)]

    def row(label, fn):
        rows.append((label, *(fn(m) for m in modes.values())))

    def pqn(d):
        return "-" if not d or d["p50"] is None else f"{d['p50']:.0f} / {d['p95']:.0f} ({d['n']})"

    row("sessions", lambda m: str(m["sessions"]))
    row("onset -> last reply sample heard, ms p50/p95 (n)", lambda m: pqn(m["stop_ms"]))
    row("  net of the peer's receive path", lambda m: pqn(m.get("net_stop_ms")))
    row("  where the reply paused", lambda m: pqn(m["paused_stop_ms"]))
    row("    net of the peer's receive path", lambda m: pqn(m.get("paused_net_stop_ms")))
    row("  over a cough", lambda m: pqn(m["cough_stop_ms"]))
    row("  over speech", lambda m: pqn(m["speech_stop_ms"]))
    row("peer's own receive path ms p50/p95", lambda m: pqn(m.get("path_ms")))
    row("  of it, up to aiortc's output", lambda m: pqn(m.get("receive_ms")))
    row("onset -> pause seen at the peer ms", lambda m: pqn(m["pause_ms"]))
    row("talked over with no pause", lambda m: str(m["unpaused"]))
    row("coughs: resumed / heard whole / all",
        lambda m: f"{m['coughs_resumed']} / {m['coughs_heard_whole']} / {m['coughs']}")
    row("microphone frames late ms p50/p95", lambda m: pqn(m["mic_late_ms"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lead = report["lead_ms"]
    lines.append(f"model {report['model']} on {report['device']}, {report['duration_s']:g} s per "
                 f"transport, seed {report['seed']}; output lead {lead['telephony']} ms "
                 f"(telephony), {lead['webrtc']} ms (webrtc), {lead['realtime']} ms (realtime)")
    return "\n".join(lines)


def run_cli(args, settings, model_name: str) -> int:
    """`duplex bench --listener ...` as the CLI parsed it; prints the table (and JSON)."""
    import sys

    from duplex.bench import show

    transports = tuple(t.strip() for t in args.transports.split(",") if t.strip())
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown or not transports:
        print(f"duplex: --transports takes {', '.join(TRANSPORTS)}", file=sys.stderr)
        return 2
    report = bench(model_name, settings, args.sessions, args.duration, transports, args.seed,
                   log=lambda line: print(line, file=sys.stderr, flush=True))
    show(table(report), report, args.json)
    return 0
