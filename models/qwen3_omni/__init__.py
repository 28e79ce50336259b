"""Qwen3-Omni: Thinker-Talker with the Code2Wav codec decoder, behind `DuplexModel`."""
