"""The engine on a thread of this process: its core runs beside the event loop and delivers
results from its own thread. The separate-process engine (process.py) serves most setups;
this one is what tests, the per-session baseline and `engine.process = false` use.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from duplex.engine import messages as m
from duplex.engine.client import EngineClient, ModelInfo
from duplex.engine.core import EngineConfig, EngineCore
from models.base import DuplexModel


def resolve_torch_threads(requested: int) -> int:
    """Threads for torch's CPU kernels. With 0, all cores but one: the event loop and the VAD
    need a core of their own, or torch's pool and they slow each other down several times."""
    import os

    return requested or max(1, (os.cpu_count() or 1) - 1)


def set_torch_threads(requested: int) -> int:
    import torch

    n = resolve_torch_threads(requested)
    torch.set_num_threads(n)
    return n


class Engine(EngineClient):
    def __init__(self, model: DuplexModel, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config or EngineConfig())
        self._core = EngineCore(model, self.config, self._on_output, clock)
        self.model = ModelInfo.of(model, self._core.startup)

    def _submit(self, request: m.Request) -> None:
        self._core.submit(request)

    def start(self) -> None:
        self._core.start()

    def stop(self) -> None:
        self._core.stop()

    @property
    def alive(self) -> bool:
        return self._core.alive
