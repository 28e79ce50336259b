"""The echo guard: what the speech detector hears, less the listener's device playing our own
reply back into its microphone.

The server knows exactly what the listener was handed and where its playback is (the pacer's
playhead on the output clock), so that audio is the echo canceller's reference. The canceller
is WebRTC's audio processing module (AEC3, as browsers run it), through the `livekit` package's
binding: a maintained native build with wheels, where the standalone speexdsp and
webrtc-audio-processing bindings on PyPI are source-only and years old.

AEC3 removes an echo well (a speakerphone's, delayed 80-250 ms, 6-20 dB down, filtered) and
keeps speech over it, but with no echo path at all (a headset) its suppressor also eats the
user's speech while a reply plays. So its output is used only while the microphone audio
correlates with what was played, within the delays a device and network add; otherwise the
detector hears the microphone as it is. The guard's strength (the session's
`audio.input.noise_reduction`) sets that correlation threshold and adds noise suppression.

The canceller costs 1-5% of a core per playing session, most of the session loop's time, and
a headset never needs it. So it starts only once an echo is first seen (a far-field microphone
declares one), caught up on the last second of audio so that it has converged by then, and
stays for the call: a speakerphone remains one.

Only the speech detector's audio passes through here; the model hears the microphone as sent.

`livekit` is imported when a canceller first starts, not with this module: the bench and the
GPU check run the same session loop on hosts that carry no livekit (78 MB installed), and
their callers never echo, so no canceller starts there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from duplex.media.rates import VAD_RATE
from duplex.media.resample import Resampler

FRAME = VAD_RATE // 100
"""The canceller's frame: 10 ms."""
_DECIMATE = 4
"""The correlation runs at 4 kHz: the band that holds most of speech's energy survives a
loudspeaker's filtering."""
_WINDOW = VAD_RATE // _DECIMATE // 4
"""250 ms of microphone audio, correlated with what was played."""
_MAX_DELAY = VAD_RATE // _DECIMATE * 2 // 5
"""400 ms: the longest device and network delay looked for."""
_TAIL_MS = 500
"""After the last audio played, the canceller stays in the path this long (the echo's tail)."""
_KEPT_OUTPUT_S = 2
_CATCH_UP = VAD_RATE
"""A canceller started late first hears the last second, the time AEC3 takes to converge."""


@dataclass(frozen=True)
class Strength:
    correlation: float
    """Microphone/played correlation above which the canceller's output is what counts."""
    noise_suppression: bool


STRENGTHS = {
    None: Strength(0.3, False),
    "near_field": Strength(0.5, False),
    "far_field": Strength(0.2, True),
}
"""`audio.input.noise_reduction`: none is the guard alone; a near-field (headset) microphone
rarely echoes, so only a clear echo engages the canceller; a far-field one (a speakerphone, a
laptop) engages it on a faint one, and noise suppression is added."""


class EchoGuard:
    def __init__(self, clock_rate: int, strength: str | None = None) -> None:
        self.clock_rate = clock_rate
        self._to_vad = Resampler(clock_rate, VAD_RATE, quality="QQ")
        self._ref_to_vad = Resampler(clock_rate, VAD_RATE, quality="QQ")
        self._output: deque[tuple[int, np.ndarray]] = deque()
        """Reply audio handed to the listener: (start on the output clock, float32 at the clock
        rate), the last couple of seconds."""
        self._ref_cursor = 0
        """Output position up to which the reference has been fed."""
        self._mic = np.zeros(0, np.float32)
        self._ref = np.zeros(0, np.float32)
        self._forget_history()
        self._active_for = clock_rate * _TAIL_MS // 1000
        self._since_played = self._active_for
        self.echo_frames = 0
        """Frames in which the canceller's output stood in for the microphone."""
        self._apm = None
        self.strength_name: str | None = None
        self.set_strength(strength)

    def set_strength(self, name: str | None) -> None:
        if name not in STRENGTHS:
            raise ValueError(f"unknown noise reduction {name!r}")
        if name == self.strength_name and self._apm is not None:
            return
        self.strength_name = name
        self.strength = STRENGTHS[name]
        self._apm = None

    def played(self, start_sample: int, pcm: np.ndarray) -> None:
        """Reply audio from `start_sample` on the output clock went to the listener."""
        # A cut output track is written again from the cut: what was there never played. And
        # what is written behind the reference's cursor plays from there on (a resend after a
        # Twilio clear goes back over what may have played): the reference follows it.
        while self._output and self._output[-1][0] >= start_sample:
            self._output.pop()
        self._output.append((start_sample, np.asarray(pcm, np.float32)))
        self._ref_cursor = min(self._ref_cursor, start_sample)
        while self._output and self._output[0][0] < start_sample - _KEPT_OUTPUT_S * self.clock_rate:
            self._output.popleft()

    def _reference(self, n: int, playhead: int) -> np.ndarray:
        """The `n` clock samples of output the listener played up to `playhead`; silence where
        nothing played (a pause, a gap, before the first reply)."""
        lo = max(self._ref_cursor, playhead - n)
        self._ref_cursor = max(self._ref_cursor, playhead)
        out = np.zeros(n, np.float32)
        if playhead <= lo:
            return out
        base = playhead - n
        for start, pcm in reversed(self._output):
            if start + len(pcm) <= lo:
                break
            a, b = max(lo, start), min(playhead, start + len(pcm))
            if a < b:
                out[a - base : b - base] = pcm[a - start : b - start]
        return out

    def clean(self, pcm: np.ndarray, playhead: int) -> np.ndarray:
        """Microphone audio at the clock rate -> what the speech detector should hear, at its
        rate. `playhead`: the output position the listener is playing now."""
        ref = self._reference(len(pcm), playhead)
        mic = np.concatenate([self._mic, self._to_vad.process(pcm)])
        ref16 = self._ref_to_vad.process(ref)
        self._since_played = 0 if np.any(ref) else self._since_played + len(pcm)
        if self._since_played >= self._active_for and not self.strength.noise_suppression:
            # Nothing played lately, so there is no echo: the detector hears every sample at
            # once, with no framing delay.
            self._mic = self._ref = np.zeros(0, np.float32)
            self._forget_history()
            return mic
        self._ref = np.concatenate([self._ref, ref16])
        n = len(mic) // FRAME * FRAME
        mic, self._mic = mic[:n], mic[n:]
        ref = self._ref[:n]
        if len(ref) < n:
            ref = np.concatenate([np.zeros(n - len(ref), np.float32), ref])
        # The reference never runs far ahead of the microphone (both come from one clock).
        self._ref = self._ref[n:][-FRAME:]
        if not n:
            return mic
        echo = self._echo_present(mic, ref)
        if self._apm is None and not (echo or self.strength.noise_suppression):
            # Whole chunks, dropped from the front: no second of audio copied per chunk.
            self._recent.append((mic, ref))
            self._recent_samples += len(mic)
            while self._recent_samples - len(self._recent[0][0]) >= _CATCH_UP:
                self._recent_samples -= len(self._recent.popleft()[0])
            return mic
        cleaned = self._cancel(mic, ref)
        if echo:
            self.echo_frames += n // FRAME
            return cleaned
        return mic

    @property
    def cancelling(self) -> bool:
        """Whether the canceller runs (an echo was seen, or the microphone is far-field)."""
        return self._apm is not None

    def _cancel(self, mic: np.ndarray, ref: np.ndarray) -> np.ndarray:
        from livekit import rtc

        if self._apm is None:
            s = self.strength
            self._apm = rtc.AudioProcessingModule(
                echo_cancellation=True, noise_suppression=s.noise_suppression,
                high_pass_filter=s.noise_suppression)
            if self._recent:
                # Chunks are whole canceller frames (clean() cuts them so).
                self._cancel(np.concatenate([m for m, _ in self._recent]),
                             np.concatenate([r for _, r in self._recent]))
            self._recent.clear()
            self._recent_samples = 0
        out = np.empty_like(mic)
        for i in range(0, len(mic), FRAME):
            self._apm.process_reverse_stream(_frame(rtc, ref[i : i + FRAME]))
            frame = _frame(rtc, mic[i : i + FRAME])
            self._apm.process_stream(frame)
            out[i : i + FRAME] = np.frombuffer(bytes(frame.data), np.int16) / 32768
        return out

    def _forget_history(self) -> None:
        # Silence, not nothing: every delay can be tried from the first frame on.
        self._mic_hist = np.zeros(_WINDOW, np.float32)
        self._ref_hist = np.zeros(_WINDOW + _MAX_DELAY, np.float32)
        self._recent: deque[tuple[np.ndarray, np.ndarray]] = deque()
        """(microphone, reference) chunks at the detector's rate, the last `_CATCH_UP` samples
        or a little more, while no canceller runs."""
        self._recent_samples = 0

    def _echo_present(self, mic: np.ndarray, ref: np.ndarray) -> bool:
        """Whether the latest microphone audio correlates with audio played up to
        `_MAX_DELAY` before it (normalised, at the best delay)."""
        self._mic_hist = np.concatenate([self._mic_hist, _decimate(mic)])[-_WINDOW:]
        self._ref_hist = np.concatenate([self._ref_hist, _decimate(ref)])[-(_WINDOW + _MAX_DELAY):]
        x, r = self._mic_hist, self._ref_hist
        energy = float(x @ x)
        if energy <= 1e-9:
            return False
        size = 1 << (len(r) + len(x)).bit_length()
        xcorr = np.fft.irfft(np.fft.rfft(r, size) * np.conj(np.fft.rfft(x, size)), size)
        # xcorr[k] = sum_i x[i] r[i + k]: the microphone's window against the played audio
        # starting k samples into the reference history (the delay is len(r) - len(x) - k).
        lags = len(r) - len(x) + 1
        cum = np.concatenate([[0.0], np.cumsum(r.astype(np.float64) ** 2)])
        seg = cum[len(x) : len(x) + lags] - cum[:lags]
        ncc = xcorr[:lags] / np.sqrt(energy * np.maximum(seg, 1e-9))
        return float(ncc.max()) >= self.strength.correlation


def _decimate(x: np.ndarray) -> np.ndarray:
    n = len(x) // _DECIMATE * _DECIMATE
    return x[:n].reshape(-1, _DECIMATE).mean(axis=1)


def warm_up() -> None:
    """Start the canceller's native side (a few hundred ms, once per process) before the
    first session needs it, not on its event loop in the middle of a reply."""
    from livekit import rtc

    apm = rtc.AudioProcessingModule(echo_cancellation=True)
    apm.process_reverse_stream(_frame(rtc, np.zeros(FRAME, np.float32)))
    apm.process_stream(_frame(rtc, np.zeros(FRAME, np.float32)))


def _frame(rtc, x: np.ndarray):
    """10 ms of float audio as the canceller's 16-bit frame."""
    data = (np.clip(x, -1, 1) * 32767).astype(np.int16).tobytes()
    return rtc.AudioFrame(data, VAD_RATE, 1, FRAME)
