"""What the check runs on each device: on a GPU, Qwen3-Omni-30B-A3B's shape within 9 minutes of
one H200; on the CPU, the tiny model through the same code in a few minutes. Standard library
only."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

PHASES = ("environment", "correctness", "stages", "bench")
"""In the order they run; the bench takes whatever time the others leave."""


@dataclass(frozen=True)
class Profile:
    device: str
    dtype: str
    """The serving dtype: of the stage timings and the bench."""
    shaped: bool
    """Qwen3-Omni-30B-A3B's widths (models/qwen3_omni/shaped.py); False: the tiny model."""
    correctness_layers: int
    """Depth of the shaped model the correctness phase builds twice (fp32 and bf16)."""
    batches: tuple[int, ...]
    repeats: int
    """Timed calls of each stage per batch size (their median is the figure)."""
    reply_steps: int
    """Greedy reply steps compared batched against alone."""
    codec_frames: int
    """Codec frames (12.5 a second) decoded in bf16 and fp32 for the SNR."""
    bench_max_sessions: int
    bench_duration_s: float
    limits_s: dict[str, float] = field(default_factory=dict)
    """Each phase's own limit; the bench's is the time left."""
    total_s: float = 540.0

    @property
    def bench_model(self) -> str:
        return "shaped:qwen3-omni-30b-a3b" if self.shaped else "tiny-omni"

    def overridden(self, settings: list[str]) -> Profile:
        """This profile with FIELD=VALUE settings (`--set repeats=2 --set batches=1,2`)."""
        kinds = {f.name: type(getattr(self, f.name)) for f in fields(self)}
        changes = {}
        for setting in settings:
            name, _, text = setting.partition("=")
            kind = kinds.get(name)
            if kind is None or kind is dict or not text:
                raise ValueError(f"{setting!r}: want FIELD=VALUE, FIELD one of "
                                 f"{', '.join(k for k, t in kinds.items() if t is not dict)}")
            if kind is tuple:
                changes[name] = tuple(int(v) for v in text.split(","))
            elif kind is bool:
                changes[name] = text.lower() in ("1", "true", "yes")
            else:
                changes[name] = kind(text)
        return replace(self, **changes)

    def save(self, out: Path) -> None:
        """Where the phases read it (`load`), and what the outputs say ran."""
        (out / "profile.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, out: Path) -> Profile:
        data = json.loads((out / "profile.json").read_text())
        return cls(**{**data, "batches": tuple(data["batches"])})


PROFILES = {
    # 9 minutes: install ~10 s; environment ~15 s; correctness builds a 2-layer model at the
    # real widths in fp32 and bf16 (~3 B parameters); stages builds the full 35 B model once
    # (10-60 s) and times five batch sizes; the bench builds it again and searches up to 64
    # sessions in 8 s levels (7 levels when all are real time).
    "cuda": Profile(
        device="cuda", dtype="bfloat16", shaped=True, correctness_layers=2,
        batches=(1, 8, 32, 64, 128), repeats=5, reply_steps=16, codec_frames=25,
        bench_max_sessions=64, bench_duration_s=8.0,
        limits_s={"environment": 45, "correctness": 120, "stages": 210}, total_s=540,
    ),
    "cpu": Profile(
        device="cpu", dtype="float32", shaped=False, correctness_layers=1,
        batches=(1, 4), repeats=3, reply_steps=4, codec_frames=6,
        bench_max_sessions=2, bench_duration_s=5.0,
        limits_s={"environment": 60, "correctness": 90, "stages": 90}, total_s=300,
    ),
}
