"""The media tracks of a call: the paced reply track out, and readers for the tracks in."""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from duplex.media import Resampler
from duplex.media.rates import REALTIME_RATE

log = logging.getLogger("duplex.webrtc")
RATE = REALTIME_RATE
TRACK_RATE = 48000
FRAME_S = 0.02
FRAME_24K = int(RATE * FRAME_S)


class ReplyTrack(MediaStreamTrack):
    """Reply audio, paced by its own 20 ms clock. The positions it has played are the playback
    watermark: `on_played(output_sample)` hears them. `flush()` drops every queued frame."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._chunks: deque[tuple[int, np.ndarray]] = deque()
        self._to_48k = Resampler(RATE, TRACK_RATE)
        self._resampled = np.zeros(0, np.float32)
        """The resampler's output runs a little behind its input; it waits here for its frame."""
        self._start: float | None = None
        self._pts = 0
        self.on_played = None
        self.played_sample = 0

    def play(self, start_sample: int, pcm: np.ndarray) -> None:
        self._chunks.append((start_sample, np.asarray(pcm, np.float32)))

    def flush(self) -> None:
        self._chunks.clear()
        self._resampled = self._resampled[:0]

    def _take(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.float32)
        filled = 0
        while filled < n and self._chunks:
            start, pcm = self._chunks[0]
            take = min(n - filled, len(pcm))
            out[filled : filled + take] = pcm[:take]
            filled += take
            self.played_sample = start + take
            if take == len(pcm):
                self._chunks.popleft()
            else:
                self._chunks[0] = (start + take, pcm[take:])
        return out

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        due = self._start + self._pts / TRACK_RATE
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        pcm = self._take(FRAME_24K)
        if self.on_played is not None:
            self.on_played(self.played_sample)
        self._resampled = np.concatenate([self._resampled, self._to_48k.process(pcm)])
        n = int(TRACK_RATE * FRAME_S)
        out = np.zeros(n, np.float32)
        usable = min(n, len(self._resampled))
        out[:usable], self._resampled = self._resampled[:usable], self._resampled[usable:]
        samples = np.clip(out * 32768, -32768, 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = TRACK_RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, TRACK_RATE)
        self._pts += len(samples)
        return frame


async def read_audio(track: MediaStreamTrack, deliver) -> None:
    """Decode the caller's audio to float32 mono 24 kHz and hand each frame to `deliver`."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        for out in resampler.resample(frame):
            deliver(out.to_ndarray().reshape(-1).astype(np.float32))


async def read_video(track: MediaStreamTrack, deliver) -> None:
    """Hand each camera frame to `deliver(rgb, pts_sample)`, its time on the 24 kHz clock.

    Sampling by timestamp happens in the session core; frames it skips are never converted.
    """
    first: int | None = None
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if frame.pts is None or frame.time_base is None:
            continue
        ticks = frame.pts * frame.time_base.numerator * RATE // frame.time_base.denominator
        first = ticks if first is None else first
        deliver(frame, ticks - first)
