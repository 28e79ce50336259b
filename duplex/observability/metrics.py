"""Prometheus metrics, one registry per app so several apps in one process stay apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from duplex import __version__
from models.base import KVStats
from models.caches import FEATURE, PREFIX, CacheStats

REFUSAL_REASONS = {"limits.sessions": "sessions",
                   "limits.sessions_per_key": "sessions_per_key"}


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        Info("duplex_build", "Server version and model", registry=self.registry).info(
            {"version": __version__, "model": model}
        )
        self.active_sessions = Gauge(
            "duplex_active_sessions", "Sessions open on this node", registry=self.registry
        )
        self.sessions_refused = Counter(
            "duplex_sessions_refused", "Sessions refused at the concurrency limits, by the limit "
            "(sessions: limits.sessions, sessions_per_key: limits.sessions_per_key)", ["reason"],
            registry=self.registry,
        )
        for reason in REFUSAL_REASONS.values():
            self.sessions_refused.labels(reason)
        self.seats_local_fallback = Counter(
            "duplex_seats_local_fallback", "Times this node found Redis unreachable and fell "
            "back to counting concurrent sessions alone", registry=self.registry,
        )
        self.telephony_rejected = Counter(
            "duplex_telephony_rejected",
            "Telephony messages refused (the call goes on), by reason",
            ["reason"],
            registry=self.registry,
        )
        self.telephony_dtmf = Counter(
            "duplex_telephony_dtmf", "DTMF digits received from calls", ["digit"],
            registry=self.registry,
        )

        latency = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
        self.stage_queue = Histogram(
            "duplex_stage_queue_seconds", "Time a payload waited before its stage ran it",
            ["stage"], buckets=latency, registry=self.registry,
        )
        self.stage_compute = Histogram(
            "duplex_stage_compute_seconds", "One batched model call of a stage", ["stage"],
            buckets=latency, registry=self.registry,
        )
        self.stage_batch = Histogram(
            "duplex_stage_batch_size", "Sessions in one batched model call", ["stage"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry,
        )
        self.ttfa = Histogram(
            "duplex_ttfa_seconds", "Response start (end of the user's turn) to its first audio sent",
            buckets=latency, registry=self.registry,
        )
        self.barge_in = Histogram(
            "duplex_barge_in_seconds",
            "Onset of the user's speech over a reply (media clock) to the reply being cut",
            buckets=latency, registry=self.registry,
        )
        self.turns_ended = Counter(
            "duplex_turns_ended", "User turns ended and committed by the turn detector, by what "
            "ended them: silence (server_vad), model (semantic_vad's end-of-turn model judged "
            "the turn complete at a pause) or fallback (semantic_vad's longest wait)", ["by"],
            registry=self.registry,
        )
        for by in ("silence", "model", "fallback"):
            self.turns_ended.labels(by)
        self.interruptions = Counter(
            "duplex_interruptions", "Replies cut by the user's speech over them",
            registry=self.registry,
        )
        self.false_interruptions = Counter(
            "duplex_false_interruptions", "Speech over a reply too short to cut it (a cough, a "
            "click): the reply paused and went on", registry=self.registry,
        )
        self.bytes_held = Gauge(
            "duplex_engine_bytes_held", "Bytes the engine holds for open sessions (KV, codec "
            "state, queues)", registry=self.registry,
        )
        self.dropped = Counter(
            "duplex_dropped", "Media dropped instead of processed, by kind and reason",
            ["kind", "reason"], registry=self.registry,
        )
        self.tool_calls_invalid = Counter(
            "duplex_tool_calls_invalid", "Tool calls the model wrote that were not the JSON its "
            "chat template asks for (reported with their raw text)", registry=self.registry,
        )
        self.caches = _CacheCollector()
        self.registry.register(self.caches)
        self.kv = _KVCollector()
        self.registry.register(self.kv)
        self.steps = _StepsCollector()
        self.registry.register(self.steps)

    def count_refusal(self, limit: str) -> None:
        """A session refused at `limit` (the setting's name, `limits.sessions` ...)."""
        self.sessions_refused.labels(REFUSAL_REASONS[limit]).inc()

    def count_interruption(self, confirmed: bool) -> None:
        (self.interruptions if confirmed else self.false_interruptions).inc()

    def sync_engine(self, engine) -> None:
        """Move the engine's new per-stage samples and drops into the metrics, so a long-running
        server's sample lists never grow without end."""
        for stage, (queue_ms, compute_ms, batch_sizes) in engine.stats.take().items():
            for values, metric, scale in ((queue_ms, self.stage_queue, 1e-3),
                                          (compute_ms, self.stage_compute, 1e-3),
                                          (batch_sizes, self.stage_batch, 1)):
                child = metric.labels(stage)
                for v in values:
                    child.observe(v * scale)
        for drop in engine.drain_drops():
            self.dropped.labels(drop.kind, drop.reason).inc(drop.n)
        self.bytes_held.set(engine.total_bytes_held())
        self.caches.stats = dict(engine.cache_stats)
        self.kv.stats = dict(getattr(engine, "kv_stats", {}))
        self.steps.stats = dict(getattr(engine, "graph_stats", {}))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CacheCollector:
    """`duplex_{prefix,feature}_cache_*` from the engine's last report: the engine counts, so
    these are its counters as they stand, not increments made here. Zero for a model without
    the cache (echo, Moshi)."""

    _COUNTERS = (("hits", "lookups that found an entry"), ("misses", "lookups that found none"),
                 ("evictions", "entries dropped to stay within the byte budget"),
                 ("refused", "entries not kept: no room within the budget"))
    _WHAT = {PREFIX: "Thinker prefix (system turn) KV cache", FEATURE: "encoder feature cache"}

    def __init__(self) -> None:
        self.stats: dict[str, CacheStats] = {}

    def collect(self):
        for name, what in self._WHAT.items():
            stats = self.stats.get(name, CacheStats())
            for field, help_text in self._COUNTERS:
                yield CounterMetricFamily(f"duplex_{name}_cache_{field}", f"{what}: {help_text}",
                                          value=getattr(stats, field))
            yield GaugeMetricFamily(f"duplex_{name}_cache_bytes", f"{what}: bytes held",
                                    value=stats.bytes)
            yield GaugeMetricFamily(f"duplex_{name}_cache_budget_bytes",
                                    f"{what}: bytes it may hold", value=stats.budget_bytes)


class _KVCollector:
    """`duplex_kv_*{stage}` from the engine's last report: the paged KV pools of the model's
    stages (none for a model whose KV is not paged)."""

    _GAUGES = (("blocks_total", "KV blocks in the stage's pool"),
               ("blocks_used", "KV blocks holding positions (sessions' and the prefix cache's)"),
               ("block_bytes", "bytes of one KV block (every layer's keys and values)"))

    def __init__(self) -> None:
        self.stats: dict[str, KVStats] = {}

    def collect(self):
        for field, help_text in self._GAUGES:
            family = GaugeMetricFamily(f"duplex_kv_{field}", help_text, labels=["stage"])
            for stage, stats in self.stats.items():
                family.add_metric([stage], getattr(stats, field))
            yield family


class _StepsCollector:
    """`duplex_model_steps_total{stage,path}` from the engine's last report: the model's
    fixed-shape steps (Thinker and Talker decode, the code predictor's frames) by how they ran:
    replays (a CUDA graph captured at start), static (its buffers without a graph), eager. None
    for a model without such steps."""

    def __init__(self) -> None:
        self.stats: dict[str, dict[str, int]] = {}

    def collect(self):
        family = CounterMetricFamily("duplex_model_steps", "Model steps by stage and by how they "
                                     "ran (replays: a CUDA graph)", labels=["stage", "path"])
        for stage, paths in self.stats.items():
            for path, n in paths.items():
                family.add_metric([stage, path], n)
        yield family
