"""What flows between stages. A bare tensor is never a payload."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    PCM_IN = "pcm_in"
    FRAME_IN = "frame_in"
    FEATURES = "features"
    TOKENS = "tokens"
    CODES = "codes"
    PCM_OUT = "pcm_out"


INPUT_KINDS = frozenset({Kind.PCM_IN, Kind.FRAME_IN, Kind.FEATURES})
"""The user's input belongs to the session's input timeline: a cancel never drops it."""


def describe(data: Any) -> tuple[tuple[int, ...], str, str]:
    """(shape, dtype, device) of an ndarray or tensor; () / 'none' / 'cpu' for anything else."""
    shape = tuple(getattr(data, "shape", ()))
    dtype = str(getattr(data, "dtype", "none"))
    device = str(getattr(data, "device", "cpu"))
    return shape, dtype, device


def nbytes(data: Any) -> int:
    if hasattr(data, "nbytes"):
        return int(data.nbytes)
    if hasattr(data, "element_size") and hasattr(data, "nelement"):
        return int(data.element_size() * data.nelement())
    return 0


@dataclass(frozen=True, slots=True)
class Payload:
    session_id: str
    epoch: int
    kind: Kind
    data: Any
    seq: int
    media_start: int
    """First sample of the media range this payload covers, on its clock."""
    media_end: int
    version: str
    final: bool = False
    text: str = ""
    enqueued_at: float = 0.0
    ids: tuple[int, ...] = ()
    """Reply tokens this payload voices (the model's context record of what was heard)."""
    ids_start: int = 0
    """The place of `ids[0]` among the reply's tokens."""
    shape: tuple[int, ...] = field(init=False)
    dtype: str = field(init=False)
    device: str = field(init=False)

    def __post_init__(self) -> None:
        shape, dtype, device = describe(self.data)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "device", device)

    @property
    def nbytes(self) -> int:
        return nbytes(self.data)
