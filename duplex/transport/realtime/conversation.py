"""The Realtime conversation: its items in order, as the client sees them and as a resume
restores them.

The kinds of item, as in OpenAI's API: messages (user, assistant, system; a client's may hold
several content parts, a reply holds one), function calls (the model's or a client's), and the
client's function call outputs; and what the server's own MCP client adds: a server's tool
listing (`mcp_list_tools`), the calls it ran (`mcp_call`), the approvals it asked for
(`mcp_approval_request`) and the client's answers (`mcp_approval_response`). Each item names
the part of the model's context it laid (`unit`, see model_context.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Item:
    id: str
    type: str = "message"
    """message | function_call | function_call_output | mcp_list_tools | mcp_call |
    mcp_approval_request | mcp_approval_response"""
    role: str | None = None
    content_type: str | None = None
    """The message's one content part: input_text, input_audio, output_audio, output_text..."""
    transcript: str | None = None
    text: str | None = None
    status: str = "completed"
    response_id: int | None = None
    """The session core's response whose audio this assistant item carries."""
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    server_label: str | None = None
    """The MCP server of an mcp_* item."""
    tools: list[dict[str, Any]] | None = None
    """An mcp_list_tools item's tools (name, description, input_schema, annotations)."""
    error: dict[str, Any] | None = None
    """Why an mcp_call failed: {type: protocol_error | http_error | tool_execution_error,
    code?, message}."""
    approval_request_id: str | None = None
    approve: bool | None = None
    reason: str | None = None
    content: list[dict[str, Any]] | None = None
    """A client message's content parts as it sent them (audio left out); None: the one part
    the fields above describe."""
    unit: int | None = None
    """The part of the model's context this item laid (a reply's items share one)."""
    output_unit: int | None = None
    """The part an mcp_call's output (or error) laid: the tool's response, a part of its own
    after the reply that made the call."""

    @property
    def units(self) -> tuple[int, ...]:
        """The parts of the model's context this item holds, in order."""
        return tuple(u for u in (self.unit, self.output_unit) if u is not None)

    def set_spoken(self, text: str) -> None:
        """The reply's text so far, where its content part keeps it."""
        if self.content_type == "output_text":
            self.text = text
        else:
            self.transcript = text

    def as_wire(self) -> dict[str, Any]:
        base: dict[str, Any] = {"id": self.id, "object": "realtime.item", "type": self.type,
                                "status": self.status}
        if self.type == "function_call":
            return {**base, "call_id": self.call_id, "name": self.name,
                    "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**base, "call_id": self.call_id, "output": self.output}
        if self.type in _MCP_WIRE:
            return {**base, **{name: getattr(self, name) for name in _MCP_WIRE[self.type]}}
        if self.content is not None:
            parts = [{**p, "transcript": self.transcript} if p["type"] == "input_audio" else p
                     for p in self.content]
            return {**base, "role": self.role, "content": parts}
        part: dict[str, Any] = {"type": self.content_type}
        if self.content_type in ("input_audio", "output_audio"):
            part["transcript"] = self.transcript
        else:
            part["text"] = self.text
        return {**base, "role": self.role, "content": [part]}

    def record(self) -> dict[str, Any]:
        """Plain JSON for the session registry; `from_record` reads it back."""
        out: dict[str, Any] = {"id": self.id, "item_type": self.type, "status": self.status}
        for name in _RECORDED:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.content_type is not None:
            out["type"] = self.content_type
        return out

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Item:
        status = data.get("status", "completed")
        return cls(
            id=data["id"],
            type=data.get("item_type", "message"),
            role=data.get("role"),
            content_type=data.get("type"),
            transcript=data.get("transcript"),
            text=data.get("text"),
            # A reply that was still playing when the connection dropped never finished.
            status="incomplete" if status == "in_progress" else status,
            call_id=data.get("call_id"),
            name=data.get("name"),
            arguments=data.get("arguments"),
            output=data.get("output"),
            **{name: data.get(name) for name in _RECORDED_MCP},
            content=data.get("content"),
            unit=data.get("unit"),
            output_unit=data.get("output_unit"),
        )


_MCP_WIRE = {
    "mcp_list_tools": ("server_label", "tools"),
    "mcp_call": ("server_label", "name", "arguments", "approval_request_id", "output", "error"),
    "mcp_approval_request": ("server_label", "name", "arguments"),
    "mcp_approval_response": ("approval_request_id", "approve", "reason"),
}
"""Each MCP item's fields as OpenAI's Realtime items name them."""
_RECORDED_MCP = ("server_label", "tools", "error", "approval_request_id", "approve", "reason")
_RECORDED = ("role", "transcript", "text", "call_id", "name", "arguments", "output",
             "content", "unit", "output_unit", *_RECORDED_MCP)


class Conversation:
    def __init__(self) -> None:
        self.items: list[Item] = []

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def find(self, item_id: str | None) -> Item | None:
        return next((i for i in self.items if i.id == item_id), None)

    def of_response(self, core_id: int) -> Item | None:
        return next((i for i in self.items if i.response_id == core_id), None)

    def append(self, item: Item) -> str | None:
        """Add `item` at the end; returns the id of the item before it."""
        previous = self.last_id
        self.items.append(item)
        return previous

    def insert(self, item: Item, after: str | None) -> str | None:
        """Add `item` after the item `after` ("root": first; None: last); returns the id of the
        item now before it. `after` must exist."""
        if after is None:
            return self.append(item)
        if after == "root":
            self.items.insert(0, item)
            return None
        index = next(i for i, existing in enumerate(self.items) if existing.id == after)
        self.items.insert(index + 1, item)
        return after

    def remove(self, item: Item) -> None:
        self.items.remove(item)

    def replace_all(self, items: list[Item]) -> None:
        self.items = items
