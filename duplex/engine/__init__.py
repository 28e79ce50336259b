"""The stage graph: per-stage queues, cross-session batching, state lifecycle, admission."""

from duplex.engine.engine import AdmissionRefused, Engine, EngineConfig, set_torch_threads
from duplex.engine.scheduler import (
    AudioOut,
    ResponseFinished,
    ResponseTimings,
    Scheduler,
    SchedulerConfig,
    SessionFailed,
    Stage,
)

__all__ = [
    "AdmissionRefused",
    "AudioOut",
    "Engine",
    "EngineConfig",
    "ResponseFinished",
    "ResponseTimings",
    "Scheduler",
    "SchedulerConfig",
    "SessionFailed",
    "Stage",
    "set_torch_threads",
]
