"""The stage graph: per-stage queues, cross-session batching, state lifecycle, admission."""

from duplex.engine.engine import AdmissionRefused, Engine, EngineConfig, set_torch_threads
from duplex.engine.process import (
    ChildSpec,
    EngineProcess,
    EngineStartFailed,
    ModelInfo,
    start_engine,
)
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
    "ChildSpec",
    "Engine",
    "EngineConfig",
    "EngineProcess",
    "EngineStartFailed",
    "ModelInfo",
    "ResponseFinished",
    "ResponseTimings",
    "Scheduler",
    "SchedulerConfig",
    "SessionFailed",
    "Stage",
    "set_torch_threads",
    "start_engine",
]
