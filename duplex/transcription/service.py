"""Input transcription for every session, off the event loop, on one worker thread.

Requests queue up while the worker recognises; it then takes up to `max_batch` of them at once
and gives each recogniser its share in one call. Unlike speech detection it does not wait to
gather a batch: a transcription is one request per utterance, and waiting would only delay it.
On the CPU a batch costs about what its utterances cost one by one; on an accelerator, one
batched call is where sharing the worker pays.

Every request ends in exactly one TranscriptionResult passed to its callback, failures
included: a full queue, unusable audio or a stopped service answer at once on the caller's
thread, and a recogniser that raises answers on the worker thread, never as an exception.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duplex.media.rates import ASR_RATE

from .recognizer import Hints, Recognizer, as_pcm

log = logging.getLogger("duplex.transcription")

QUEUE_FULL = "queue_full"
INVALID_AUDIO = "invalid_audio"
RECOGNITION_FAILED = "recognition_failed"
STOPPED = "stopped"


@dataclass(frozen=True)
class TranscriptionError:
    code: str
    """queue_full, invalid_audio, recognition_failed or stopped."""
    message: str


@dataclass(frozen=True)
class TranscriptionResult:
    text: str
    model: str
    audio_s: float
    error: TranscriptionError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


Callback = Callable[[TranscriptionResult], None]


@dataclass
class _Request:
    recognizer: Recognizer
    pcm: np.ndarray
    callback: Callback
    hints: Hints = Hints()

    def result(
        self, text: str = "", error: TranscriptionError | None = None
    ) -> TranscriptionResult:
        return TranscriptionResult(text, self.recognizer.name, len(self.pcm) / ASR_RATE, error)


class TranscriptionService:
    def __init__(self, max_queue: int = 64, max_batch: int = 8) -> None:
        self.max_queue = max_queue
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        # Counted by hand, not by a bounded queue: stop() must always get its wake-up in.
        self._pending = 0
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="duplex-asr", daemon=True)
        self._thread.start()

    def submit(self, recognizer: Recognizer, pcm: np.ndarray, callback: Callback,
               hints: Hints | None = None) -> None:
        """Queue 16 kHz float32 mono audio; `callback(result)` runs once with its text."""
        try:
            request = _Request(recognizer, as_pcm(pcm), callback, hints or Hints())
        except ValueError as exc:
            request = _Request(recognizer, np.zeros(0, np.float32), callback)
            _deliver(request, request.result(error=TranscriptionError(INVALID_AUDIO, str(exc))))
            return
        with self._lock:
            refused = None
            if self._stopped:
                refused = TranscriptionError(STOPPED, "the transcription service has stopped")
            elif self._pending >= self.max_queue:
                refused = TranscriptionError(
                    QUEUE_FULL, f"{self._pending} transcriptions are already waiting"
                )
            else:
                self._pending += 1
                self._queue.put(request)
        if refused is not None:
            _deliver(request, request.result(error=refused))

    async def transcribe(self, recognizer: Recognizer, pcm: np.ndarray) -> TranscriptionResult:
        """submit() for a coroutine: the loop keeps running while the worker recognises."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TranscriptionResult] = loop.create_future()

        def settle(result: TranscriptionResult) -> None:
            if not future.done():
                future.set_result(result)

        self.submit(recognizer, pcm, lambda r: loop.call_soon_threadsafe(settle, r))
        return await future

    def stop(self) -> None:
        """Refuse new requests and answer the waiting ones with `stopped`."""
        with self._lock:
            self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            requests = [r for r in batch if r is not None]
            with self._lock:
                self._pending -= len(requests)
                stopped = self._stopped
            if stopped:
                error = TranscriptionError(STOPPED, "the transcription service has stopped")
                for r in requests:
                    _deliver(r, r.result(error=error))
                if None in batch:
                    return
                continue
            groups: dict[int, list[_Request]] = {}
            for r in requests:
                groups.setdefault(id(r.recognizer), []).append(r)
            for group in groups.values():
                self._recognize(group)

    def _recognize(self, group: list[_Request]) -> None:
        recognizer = group[0].recognizer
        try:
            texts = recognizer.transcribe_batch([r.pcm for r in group], [r.hints for r in group])
        except Exception as exc:
            log.exception("transcription with %s failed", recognizer.name)
            error = TranscriptionError(RECOGNITION_FAILED, f"{type(exc).__name__}: {exc}")
            for r in group:
                _deliver(r, r.result(error=error))
            return
        for r, text in zip(group, texts, strict=True):
            _deliver(r, r.result(text))


def _deliver(request: _Request, result: TranscriptionResult) -> None:
    try:
        request.callback(result)
    except Exception:
        log.exception("a transcription result could not be delivered")
