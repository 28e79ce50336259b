"""Clock rates fixed by the wire protocols, the speech detector and the recognisers, declared
once."""

REALTIME_RATE = 24000
"""OpenAI Realtime's PCM rate (its only one), and the session clock of Realtime and WebRTC."""

VAD_RATE = 16000
VAD_CHUNK = 512
"""silero-vad scores 512-sample windows at 16 kHz (32 ms)."""

ASR_RATE = 16000
"""What the speech recognisers take (Whisper's rate)."""
