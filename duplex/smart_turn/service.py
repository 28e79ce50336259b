"""End-of-turn scoring for every session, off the event loop, on one worker thread.

A session asks once per pause (not per frame), so requests are few; the worker takes all that
wait when it wakes and scores them in one call. Batching gains little on the CPU (the graph
costs about the same per turn either way) but never waits for company: a pause's score is on
the reply's critical path. A request its session no longer wants by the time the worker gets
to it (the speech went on, or a later pause asked again) is dropped unscored: when the worker
falls behind, it spends nothing on answers nobody reads. A turn the model fails on is
answered None: no judgement, and the turn ends by its fallback wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duplex.smart_turn.model import SmartTurn

log = logging.getLogger("duplex.smart_turn")

Callback = Callable[[float | None], None]


@dataclass(frozen=True)
class _Request:
    pcm: np.ndarray
    callback: Callback
    wanted: Callable[[], bool]


class TurnEndService:
    def __init__(self, model: SmartTurn, max_batch: int = 16) -> None:
        self.model = model
        self.max_batch = max_batch
        self.scored = 0
        self.dropped = 0
        """Requests no longer wanted when their turn came."""
        self.busy_s = 0.0
        """Seconds the worker spent scoring, for the bench."""
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="duplex-turn-end", daemon=True)
        self._thread.start()

    def submit(self, pcm: np.ndarray, callback: Callback,
               wanted: Callable[[], bool] = lambda: True) -> None:
        """Score the turn in `pcm` (16 kHz float32); `callback(probability)` runs on the
        worker with the probability that it is complete (None if the model failed), unless
        `wanted()` (asked on the worker, just before) says the answer is no longer needed."""
        self._queue.put(_Request(pcm, callback, wanted))

    def stop(self) -> None:
        """Stop at once: what still waits is not scored."""
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._stopped or None in batch:
                return
            requests = [r for r in batch if r.wanted()]
            self.dropped += len(batch) - len(requests)
            if requests:
                self._score(requests)

    def _score(self, requests: list[_Request]) -> None:
        start = time.perf_counter()
        probs = self._complete(requests)
        self.busy_s += time.perf_counter() - start
        self.scored += len(requests)
        for r, p in zip(requests, probs, strict=True):
            try:
                r.callback(p)
            except Exception:
                log.exception("an end-of-turn score could not be delivered")

    def _complete(self, requests: list[_Request]) -> list[float | None]:
        try:
            return list(self.model.complete([r.pcm for r in requests]))
        except Exception:
            if len(requests) > 1:
                # One bad turn must not cost the others their answer.
                return [p for r in requests for p in self._complete([r])]
            log.exception("Smart Turn could not score a turn")
            return [None]
