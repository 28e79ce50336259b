"""Building the Realtime server events: ids, the beta spellings, and the response object."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any

from duplex.access.errors import error_object
from duplex.transport.effects import Send
from duplex.transport.realtime.conversation import Item
from duplex.transport.realtime.session_config import ResponseSettings, flat_format, format_wire

_BETA_NAMES = {
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "conversation.item.added": "conversation.item.created",
}
_NOT_IN_BETA = frozenset({"conversation.item.done"})


@dataclass
class ActiveResponse:
    """The reply being generated or played: its item, settings and what was sent of it."""

    id: str
    core_id: int
    epoch: int
    item: Item
    settings: ResponseSettings
    engine_done: bool = False
    usage: dict[str, Any] | None = None
    """What the engine reported of the reply's context (`ResponseFinished.usage`)."""
    finish_reason: str = "completed"
    audio_started: bool = False
    transcript: list[str] = field(default_factory=list)
    calls: dict[int, Item] = field(default_factory=dict)
    """The calls the model wrote in this reply (function and MCP), by their order in it."""
    pending: set[str] = field(default_factory=set)
    """The MCP calls of this reply still running (it ends once they have)."""

    def output(self) -> list[Item]:
        return [self.item, *self.calls.values()]


class EventWriter:
    def __init__(self, beta: bool) -> None:
        self.beta = beta
        self._ids = itertools.count(1)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}{secrets.token_hex(4)}"

    def emit(self, out: list, type_: str, **fields: Any) -> None:
        """Append the event `type_` in the client's spelling (beta clients lack some)."""
        if self.beta:
            if type_ in _NOT_IN_BETA:
                return
            type_ = _BETA_NAMES.get(type_, type_)
        out.append(Send({"type": type_, "event_id": self.new_id("event"), **fields}))

    def error(self, out: list, kind: str, code: str, message: str, param: str | None,
              client_event_id: str | None) -> None:
        self.emit(out, "error", error=error_object(kind, code, message, param, client_event_id))

    def response_object(self, r: ActiveResponse, status: str, details: dict[str, Any] | None,
                        conversation_id: str) -> dict[str, Any]:
        rs = r.settings
        wire: dict[str, Any] = {
            "id": r.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": [i.as_wire() for i in r.output()] if status != "in_progress" else [],
            "conversation_id": None if rs.conversation == "none" else conversation_id,
            "max_output_tokens": rs.max_output_tokens,
            "metadata": rs.metadata,
            "usage": usage_wire(r.usage) if status != "in_progress" else None,
        }
        if self.beta:
            wire.update(modalities=list(rs.output_modalities), voice=rs.voice,
                        output_audio_format=flat_format(rs.output_format),
                        temperature=rs.temperature)
        else:
            wire.update(output_modalities=list(rs.output_modalities),
                        audio={"output": {"format": format_wire(rs.output_format),
                                          "voice": rs.voice}})
        return wire


def usage_wire(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's usage object, with duplex's `truncation` (the session's policy and how many
    context tokens it dropped while this reply's input came in) as an extension field."""
    if usage is None:
        return None
    inp, out = usage["input_tokens"], usage["output_tokens"]
    return {
        "total_tokens": inp + out, "input_tokens": inp, "output_tokens": out,
        "input_token_details": {"cached_tokens": usage["cached_tokens"]},
        "output_token_details": {"text_tokens": out},
        "truncation": {"type": usage["truncation"],
                       "truncated_tokens": usage["truncated_tokens"]},
    }
