"""Synthetic speech: voiced syllables with formants and consonant bursts.

silero-vad hears it as speech (probability > 0.9 within ~64 ms of onset), so the benchmark and
tests can drive real turn detection without shipping recordings.
"""

import numpy as np

_VOWEL_FORMANTS = (
    (730, 1090, 2440),
    (270, 2290, 3010),
    (300, 870, 2240),
    (530, 1840, 2480),
    (570, 840, 2410),
    (660, 1720, 2410),
)


def babble(n_samples: int, rate: int = 24000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pieces: list[np.ndarray] = []
    total = 0
    ir_t = np.arange(int(0.03 * rate)) / rate
    while total < n_samples:
        n_syl = int(rate * rng.uniform(0.15, 0.3))
        t = np.arange(n_syl) / rate
        f0 = rng.uniform(100, 180) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(1, 3) * t))
        pulses = (np.diff(np.floor(np.cumsum(f0 / rate)), prepend=0) > 0).astype(np.float64)
        formants = _VOWEL_FORMANTS[rng.integers(len(_VOWEL_FORMANTS))]
        ir = sum(
            np.exp(-np.pi * 80 * ir_t) * np.sin(2 * np.pi * f * ir_t) / (k + 1)
            for k, f in enumerate(formants)
        )
        vowel = np.convolve(pulses, ir)[:n_syl] * np.hanning(n_syl)
        n_cons = int(rate * 0.04)
        consonant = rng.standard_normal(n_cons) * 0.3 * np.hanning(n_cons)
        pieces += [consonant, vowel / np.abs(vowel).max() * rng.uniform(0.3, 0.6)]
        total += n_syl + n_cons
    return np.concatenate(pieces)[:n_samples].astype(np.float32)
