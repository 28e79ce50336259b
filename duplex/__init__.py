"""duplex: a real-time, full-duplex voice/video session server for Thinker-Talker models."""

__version__ = "0.1.0"
