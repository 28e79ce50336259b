"""The media tracks of a call: the paced reply track out, and readers for the tracks in."""

from __future__ import annotations

import asyncio
import fractions
import logging
import time
from collections import deque
from collections.abc import Callable

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from duplex.media.fir import FirResampler
from duplex.media.rates import REALTIME_RATE

log = logging.getLogger("duplex.webrtc")
RATE = REALTIME_RATE
TRACK_RATE = 48000
FRAME_S = 0.02
FRAME_24K = int(RATE * FRAME_S)


class ReplyTrack(MediaStreamTrack):
    """Reply audio, paced by its own 20 ms clock (`clock`: seconds, monotonic). The positions it
    has played are the playback watermark: `on_played(output_sample)` hears them. `hold()`
    plays silence from the next frame on and keeps what is queued, `resume()` plays it on from
    there, `flush()` drops every queued frame."""

    kind = "audio"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._chunks: deque[tuple[int, np.ndarray]] = deque()
        # A FIR of 1.3 ms delay: soxr's HQ stream holds back 20-40 ms, all of which would go
        # on playing after a hold.
        self._to_48k = FirResampler(RATE, TRACK_RATE)
        self._resampled = np.zeros(self._to_48k.lookahead, np.float32)
        """The resampler's output, a frame's worth behind its input and waiting for its frame:
        it starts as silence as long as the filter holds back, so every frame is whole."""
        self._start: float | None = None
        self._pts = 0
        self.on_played = None
        self.played_sample = 0
        self.held = False

    def play(self, start_sample: int, pcm: np.ndarray) -> None:
        self._chunks.append((start_sample, np.asarray(pcm, np.float32)))

    def hold(self) -> None:
        self.held = True

    def resume(self) -> None:
        self.held = False

    def flush(self) -> None:
        self._chunks.clear()
        self._resampled = self._resampled[:0]
        self.held = False

    def _take(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.float32)
        if self.held:
            return out
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
            self._start = self._clock()
        due = self._start + self._pts / TRACK_RATE
        await asyncio.sleep(max(0.0, due - self._clock()))
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
