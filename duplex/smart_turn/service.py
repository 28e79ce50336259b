"""End-of-turn scoring for every session, off the event loop, on one worker thread.

A session asks once per pause (not per frame), so requests are few; the worker takes all that
wait when it wakes and scores them in one call. Batching gains little on the CPU (the graph
costs about the same per turn either way) but never waits for company: a pause's score is on
the reply's critical path. A turn the model fails on is answered None: no judgement, and
the turn ends by its fallback wait.
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


class TurnEndService:
    def __init__(self, model: SmartTurn, max_batch: int = 16) -> None:
        self.model = model
        self.max_batch = max_batch
        self.scored = 0
        self.busy_s = 0.0
        """Seconds the worker spent scoring, for the bench."""
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="duplex-turn-end", daemon=True)
        self._thread.start()

    def submit(self, pcm: np.ndarray, callback: Callback) -> None:
        """Score the turn in `pcm` (16 kHz float32); `callback(probability)` runs on the
        worker with the probability that it is complete (None if the model failed)."""
        self._queue.put(_Request(pcm, callback))

    def stop(self) -> None:
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
            requests = [r for r in batch if r is not None]
            if requests:
                self._score(requests)
            if None in batch:
                return

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
