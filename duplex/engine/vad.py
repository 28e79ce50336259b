"""Speech probability with silero-vad, batched across sessions, state carried per stream.

silero's scripted model keeps one hidden state for one batch; here each session keeps its own
(state, last input) and a batch call stacks them, so many sessions cost one forward.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from duplex.media.rates import VAD_CHUNK, VAD_RATE
from duplex.smart_turn.service import TurnEndService

log = logging.getLogger("duplex.vad")
_CONTEXT = 64


def _load_jit():
    threads = torch.get_num_threads()
    from silero_vad import load_silero_vad

    model = load_silero_vad(onnx=False)
    # Importing silero_vad sets torch to one thread for the whole process; undo that.
    torch.set_num_threads(threads)
    return model


@dataclass
class VadStream:
    state: torch.Tensor = field(default_factory=lambda: torch.zeros(2, 1, 128))
    last_input: np.ndarray = field(
        default_factory=lambda: np.zeros(_CONTEXT + VAD_CHUNK, np.float32))
    """What the model was last given: the last complete chunk after its context. Its tail is
    the next chunk's context; with `pending`, it is also the latest 512 samples `early`
    scores."""
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))


@dataclass(frozen=True)
class SpeechProbabilities:
    """What the detector made of one submission."""

    chunks: list[float]
    """One probability per complete 512-sample chunk, in order."""
    early: float | None = None
    """Audio submitted urgent that left part of a chunk pending: the latest 512 samples' own
    probability (`SileroVAD.early`), a chunk's wait ahead of the grid."""


class SileroVAD:
    def __init__(self) -> None:
        self._model = _load_jit()._model

    @torch.inference_mode()
    def process(self, streams: list[VadStream], chunks: list[np.ndarray]) -> list[list[float]]:
        """Feed 16 kHz float32 audio per stream; one probability per complete 512-sample chunk."""
        for stream, chunk in zip(streams, chunks, strict=True):
            stream.pending = np.concatenate([stream.pending, np.asarray(chunk, np.float32)])
        probs: list[list[float]] = [[] for _ in streams]
        while True:
            ready = [i for i, s in enumerate(streams) if len(s.pending) >= VAD_CHUNK]
            if not ready:
                return probs
            x = torch.from_numpy(np.stack([streams[i].pending[:VAD_CHUNK] for i in ready]))
            context = torch.from_numpy(np.stack([streams[i].last_input[-_CONTEXT:]
                                                 for i in ready]))
            state = torch.cat([streams[i].state for i in ready], dim=1)
            x = torch.cat([context, x], dim=1)
            out, state = self._model(x, state)
            for row, i in enumerate(ready):
                s = streams[i]
                s.pending = s.pending[VAD_CHUNK:]
                s.state = state[:, row : row + 1].clone()
                s.last_input = x[row].numpy().copy()
                probs[i].append(float(out[row]))

    @torch.inference_mode()
    def early(self, streams: list[VadStream]) -> list[float | None]:
        """Each stream's latest 512 samples, scored with the state its last complete chunk
        left, without changing anything: speech that began inside the chunk still filling
        shows here up to a chunk (32 ms) before that chunk is complete (on the bench's
        recordings, onset to a decision: 76 / 111 ms p50 / p95 on the chunk grid, 59 / 92
        this way; no noise, click or tone passed 0.5 either way). None for a stream with
        nothing pending: its latest audio was a complete chunk, already scored."""
        rows = [i for i, s in enumerate(streams) if len(s.pending)]
        out: list[float | None] = [None] * len(streams)
        if rows:
            x = torch.from_numpy(np.stack([
                np.concatenate([streams[i].last_input[len(streams[i].pending):],
                                streams[i].pending]) for i in rows]))
            state = torch.cat([streams[i].state for i in rows], dim=1)
            probs, _ = self._model(x, state)
            for row, i in enumerate(rows):
                out[i] = float(probs[row])
        return out


class VadService:
    """One thread that runs speech detection for every session, batched per wake-up.

    After the first audio arrives the thread waits `gather_s` (one VAD chunk) for the other
    sessions' frames, so all of them share one forward. Woken per frame instead, it ran a small
    forward for a few sessions at a time and took 44% of a core at 45 sessions; 12% this way.
    The price is up to one chunk (32 ms) more before a speech start is detected. Audio
    submitted `urgent` (a session whose reply is playing: a barge-in pauses it) ends the wait
    at once, taking along whatever the other sessions sent so far.
    """

    def __init__(self, gather_s: float = VAD_CHUNK / VAD_RATE,
                 turn_end: TurnEndService | None = None) -> None:
        self.gather_s = gather_s
        self.turn_end = turn_end
        """The end-of-turn model's worker, which semantic_vad asks at a pause (its own thread:
        a score costs tens of milliseconds, which no session's speech detection waits for);
        None on a server without it."""
        self._vad = SileroVAD()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="duplex-vad", daemon=True)
        self._thread.start()

    @staticmethod
    def new_stream() -> VadStream:
        """A session's detector state, its own from the first chunk."""
        return VadStream()

    def submit(self, stream: VadStream, pcm: np.ndarray, callback, urgent: bool = False) -> None:
        """Queue 16 kHz audio; `callback(probs)` runs on the VAD thread with its probabilities.
        `urgent`: run the batch now rather than wait for other sessions' audio."""
        self._queue.put((stream, pcm, callback, urgent))

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        if self.turn_end is not None:
            self.turn_end.stop()

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.gather_s
            urgent = first[3]
            while True:
                try:
                    item = (self._queue.get_nowait() if urgent else
                            self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
                if item is None:
                    return
                batch.append(item)
                urgent = urgent or item[3]
            merged: dict[int, tuple[VadStream, list[np.ndarray], object]] = {}
            for stream, pcm, callback, _ in batch:
                merged.setdefault(id(stream), (stream, [], callback))[1].append(pcm)
            entries = list(merged.values())
            streams = [s for s, _, _ in entries]
            probs = self._vad.process(streams, [np.concatenate(p) for _, p, _ in entries])
            hurried = {id(stream) for stream, _, _, urgent in batch if urgent}
            ahead = [s for s in streams if id(s) in hurried]
            early = {id(s): e for s, e in zip(ahead, self._vad.early(ahead), strict=True)}
            for (stream, _, callback), p in zip(entries, probs, strict=True):
                result = SpeechProbabilities(p, early.get(id(stream)))
                if p or result.early is not None:
                    try:
                        callback(result)
                    except Exception:
                        log.exception("a VAD result could not be delivered")
