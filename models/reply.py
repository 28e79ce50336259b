"""What one reply is asked to be, as the session asked it: the parts a model acts on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ReplySpec:
    audio: bool = True
    """False: the Thinker alone runs and the reply is text (no Talker, no codec)."""
    max_output_tokens: int | None = None
    """Thinker tokens after which the reply ends, incomplete; None for no limit."""
    instructions: str = ""
    """The system turn of the Thinker's context."""
    voice: str | None = None
    """A speaker of the model's Talker; None for its default."""
    temperature: float | None = None
    """Sampling temperature; 0 is greedy (and so deterministic); None for the model's own."""
    tools: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    tool_choice: str | dict[str, Any] = "auto"
