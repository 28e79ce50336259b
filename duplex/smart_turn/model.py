"""Smart Turn v3.2 on onnxruntime: the last 8 s of a turn at 16 kHz -> the probability that the
speaker has finished.

The graph takes Whisper's log-mel features (80 mels, 10 ms hops, 8 s), the same features
`transformers.WhisperFeatureExtractor(chunk_length=8)` makes with `do_normalize=True`
(tests/smart_turn checks they agree); they are computed here with numpy alone, in one batched
FFT, since the server process loads no transformers and the per-frame loop of the reference
costs several times the model's own call.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

RATE = 16000
WINDOW = 8 * RATE
"""The model hears the last 8 s; a shorter turn is padded with silence in front."""
_N_FFT = 400
_HOP = 160
_N_MELS = 80


def _slaney_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, np.float64)
    log_region = hz >= 1000.0
    mel = 3.0 * hz / 200.0
    return np.where(log_region, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * 27.0 / np.log(6.4),
                    mel)


def _slaney_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)),
                    200.0 * mel / 3.0)


def _mel_filters() -> np.ndarray:
    """Slaney-normalised triangular filters, (n_fft // 2 + 1, 80), 0 Hz to 8 kHz."""
    edges = _slaney_hz(np.linspace(_slaney_mel(0.0), _slaney_mel(RATE / 2), _N_MELS + 2))
    bins = np.linspace(0, RATE // 2, _N_FFT // 2 + 1)
    slopes = edges[None, :] - bins[:, None]
    width = np.diff(edges)
    down = -slopes[:, :-2] / width[:-1]
    up = slopes[:, 2:] / width[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]


_FILTERS = _mel_filters()
_HANN = np.hanning(_N_FFT + 1)[:-1]
"""Periodic Hann, as torch.hann_window and Whisper use."""


def last_window(pcm: np.ndarray) -> np.ndarray:
    """The last 8 s of `pcm` (16 kHz), silence in front of a shorter one."""
    pcm = np.asarray(pcm, np.float32)
    if pcm.ndim != 1:
        raise ValueError(f"a turn is mono audio, not an array of shape {pcm.shape}")
    pcm = pcm[-WINDOW:]
    return np.pad(pcm, (WINDOW - len(pcm), 0))


def features(pcm: np.ndarray) -> np.ndarray:
    """Whisper log-mel features (80, 800) of exactly 8 s of 16 kHz audio."""
    x = np.asarray(pcm, np.float32)
    if x.shape != (WINDOW,):
        raise ValueError(f"features take {WINDOW} samples, not {x.shape}")
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x.astype(np.float64), _N_FFT // 2, mode="reflect")
    frames = sliding_window_view(padded, _N_FFT)[::_HOP]
    power = np.abs(np.fft.rfft(frames * _HANN, axis=-1)) ** 2
    log_spec = np.log10(np.maximum(1e-10, power @ _FILTERS)).T[:, :-1]
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


class SmartTurn:
    """One onnxruntime session over the graph; `threads` cores for one call."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(path), sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name

    def complete(self, turns: list[np.ndarray]) -> list[float]:
        """For each turn (16 kHz float32, any length; its last 8 s count), the probability
        that it is complete."""
        if not turns:
            return []
        batch = np.stack([features(last_window(t)) for t in turns])
        (probs,) = self._session.run(None, {self._input: batch})
        return [float(p) for p in np.asarray(probs).reshape(len(turns))]
