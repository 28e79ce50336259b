"""Audio conversions at the edges: PCM16 <-> float, resampling, G.711, fixed-size framing."""

from duplex.media.framing import Framer
from duplex.media.g711 import (
    alaw_decode,
    alaw_encode,
    float_to_g711,
    g711_to_float,
    ulaw_decode,
    ulaw_encode,
)
from duplex.media.pcm import float_to_pcm16, pcm16_to_float
from duplex.media.resample import SUPPORTED_RATES, Resampler, resample

__all__ = [
    "SUPPORTED_RATES",
    "Framer",
    "Resampler",
    "alaw_decode",
    "alaw_encode",
    "float_to_g711",
    "float_to_pcm16",
    "g711_to_float",
    "pcm16_to_float",
    "resample",
    "ulaw_decode",
    "ulaw_encode",
]
