"""The stage graph: per-stage queues, cross-session batching, state lifecycle, admission."""

from duplex.engine.client import AdmissionRefused, EngineClient, ModelInfo
from duplex.engine.core import EngineConfig
from duplex.engine.engine import Engine, set_torch_threads
from duplex.engine.process import ChildSpec, EngineProcess, EngineStartFailed, start_engine
from duplex.engine.scheduler import (
    AudioOut,
    ResponseFinished,
    ResponseTimings,
    Scheduler,
    SchedulerConfig,
    SessionFailed,
    Stage,
    TextOut,
    ToolCallOut,
)

__all__ = [
    "AdmissionRefused",
    "AudioOut",
    "ChildSpec",
    "Engine",
    "EngineClient",
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
    "TextOut",
    "ToolCallOut",
    "set_torch_threads",
    "start_engine",
]
