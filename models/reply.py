"""What one reply is asked to be, as the session asked it: the parts a model acts on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Truncation:
    """`auto`: drop the oldest quarter of the context past the system turn. `retention_ratio`:
    drop the oldest until `ratio` of the post-instruction limit is in use. `disabled`: drop
    nothing; input that does not fit is refused and the reply ends with
    `context_length_exceeded`. `post_instructions` lowers the limit (OpenAI's token_limits)."""

    type: str = "auto"
    ratio: float = 1.0
    post_instructions: int | None = None

    @classmethod
    def of(cls, setting: str | dict[str, Any] | None) -> Truncation:
        """The session's `truncation` as clients send it."""
        if setting is None or isinstance(setting, str):
            return cls(setting or "auto")
        limits = setting.get("token_limits") or {}
        return cls("retention_ratio", float(setting["retention_ratio"]),
                   limits.get("post_instructions"))


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
    truncation: Truncation = field(default_factory=Truncation)
    """What the Thinker does when its context fills (the session's `truncation`)."""
