"""A Twilio call as a sideband sees it: the OpenAI Realtime face of the bridge's session.

The Twilio bridge runs a protocol of its own (protocol.py), not a Realtime session: its
carrier is Twilio's wire, which has no event stream. A sideband (`/v1/realtime?call_id=`,
duplex.transport.sideband) still needs one, and needs its client events to act on the call.
This view gives both, pure and I/O-free like the protocol that owns it: the call's replies,
speech turns and tool calls as Realtime server events (`Publish`, for the sidebands alone),
and the four client events a sideband drives a call with, which it validates with the Realtime
schema and hands to the protocol as session commands:

- `session.update` sets instructions, tools (function tools) and tool_choice; the call's audio
  and turn detection are the bridge's (`telephony.*`) and are refused here;
- `response.create` starts a reply the caller hears, as a turn's end does;
- `conversation.item.create` lays a `function_call_output` (or a text message) in the model's
  context;
- `response.cancel` cuts the reply playing, as a barge-in does.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from duplex.access.errors import error_object
from duplex.engine.thinker_text import CallArguments, CallDone, CallStarted
from duplex.session import events as ev
from duplex.session.errors import SessionError
from duplex.transport.core import json_object
from duplex.transport.effects import EngineInstruct, EnginePushText
from duplex.transport.realtime import schema
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.realtime.session_config import (
    ConfigError,
    SessionSettings,
    ga_session,
    updated_ga,
)
from models.reply import ReplySpec

SETTABLE = frozenset({"type", "instructions", "tools", "tool_choice"})
"""What a sideband may set on a Twilio call (the rest is the bridge's)."""
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "text", "output_text"})


@dataclass(frozen=True)
class Publish:
    """A Realtime server event for the call's sidebands (Twilio hears none)."""

    event: dict[str, Any]


@dataclass
class _Reply:
    id: str
    message_id: str
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The function calls the model wrote in this reply, by their order in it."""


class RealtimeView:
    """Owned by a TwilioProtocol: it reports the call's core events here and asks
    `receive` what a sideband's text means for the call."""

    def __init__(self, session_id: str, model: str, turn_detection: str) -> None:
        self.session_id = session_id
        self.model = model
        self.settings = SessionSettings(
            input_format="audio/pcmu", output_format="audio/pcmu",
            turn_detection=schema.TurnDetection(type=turn_detection))
        self._ids = itertools.count(1)
        self._replies: dict[int, _Reply] = {}
        """Replies under way, by their id on the session core."""
        self.call_ids: set[str] = set()
        """The function calls of the call so far: a function_call_output must answer one."""

    def new_id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids):06d}{secrets.token_hex(4)}"

    def emit(self, out: list, type_: str, **fields: Any) -> None:
        out.append(Publish({"type": type_, "event_id": self.new_id("event"), **fields}))

    def session_object(self) -> dict[str, Any]:
        return ga_session(self.settings, self.session_id, self.model)

    def attached(self) -> dict[str, Any]:
        """session.created for a sideband attaching now: the session as it stands."""
        return {"type": "session.created", "event_id": self.new_id("event"),
                "session": self.session_object()}

    def spec(self) -> ReplySpec:
        """What a reply of the call is told: the session's instructions and tools."""
        s = self.settings
        return ReplySpec(instructions=s.instructions, tools=s.tools, tool_choice=s.tool_choice)

    # -- a sideband's client events -----------------------------------------------------------

    def receive(self, out: list, text: str, handlers: dict[str, Callable]) -> None:
        """Validate a sideband's text frame and run its handler; an error event names what
        was wrong with it. `handlers` are the protocol's, by event type."""
        raw = json_object(text)
        if isinstance(raw, str):
            self.error(out, "invalid_json", f"The message is {raw}.")
            return
        event_id = raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
        type_ = raw.get("type")
        handler = handlers.get(type_) if isinstance(type_, str) else None
        if handler is None:
            self.error(out, "invalid_event_type",
                       f"A sideband on a Twilio call may send {', '.join(handlers)}; not "
                       f"{type_!r}.", "type", event_id)
            return
        try:
            handler(schema.CLIENT_EVENTS[type_].model_validate(raw), out)
        except ValidationError as exc:
            param, message = schema.first_problem(exc)
            self.error(out, "invalid_value", message, param, event_id)
        except ConfigError as exc:
            self.error(out, exc.code, str(exc), exc.param, event_id)
        except (ProtocolError, SessionError) as exc:
            self.error(out, exc.code, str(exc), getattr(exc, "param", None), event_id)

    def error(self, out: list, code: str, message: str, param: str | None = None,
              event_id: str | None = None) -> None:
        self.emit(out, "error", error=error_object("invalid_request_error", code, message, param,
                                                   event_id))

    def update(self, event: schema.SessionUpdate, out: list) -> None:
        """session.update: instructions, function tools and tool_choice."""
        other = sorted(set(event.session) - SETTABLE)
        if other:
            raise ProtocolError("unsupported_on_twilio",
                          f"'session.{other[0]}' cannot be set on a Twilio call: its audio and "
                          "turn detection are the bridge's (telephony.*). A sideband sets "
                          f"{', '.join(sorted(SETTABLE - {'type'}))}.", f"session.{other[0]}")
        new = updated_ga(self.settings, event.session)
        if new.type != "realtime":
            raise ProtocolError("unsupported_on_twilio", "A Twilio call is a realtime session.",
                          "session.type")
        for i, tool in enumerate(new.tools):
            if tool.get("type") != "function":
                raise ProtocolError("unsupported_on_twilio",
                              "A Twilio call takes function tools, not MCP servers.",
                              f"session.tools.{i}.type")
        told = (self.settings.instructions, self.settings.tools)
        self.settings = replace(new, mcp_headers={})
        self.emit(out, "session.updated", session=self.session_object())
        if (new.instructions, new.tools) != told:
            out.append(EngineInstruct(new.instructions, new.tools))

    def item(self, event: schema.ItemCreate, out: list) -> None:
        """conversation.item.create: a function call's output, or a text message."""
        model = schema.ITEM_TYPES.get(event.item.get("type", "message"))
        if model not in (schema.FunctionCallOutputItem, schema.MessageItem):
            raise ProtocolError("unsupported_on_twilio",
                          "A Twilio call takes function_call_output and message items, not "
                          f"{event.item.get('type')!r}.", "item.type")
        try:
            item = model.model_validate(event.item)
        except ValidationError as exc:
            param, message = schema.first_problem(exc, "item.")
            raise ProtocolError("invalid_value", message, param) from None
        if isinstance(item, schema.FunctionCallOutputItem):
            if item.call_id not in self.call_ids:
                raise ProtocolError("invalid_tool_call_id",
                              f"Tool call ID '{item.call_id}' not found in conversation.",
                              "item.call_id")
            push = EnginePushText(item.output, role="tool")
            wire = {"type": "function_call_output", "call_id": item.call_id,
                    "output": item.output}
        else:
            parts = [p for p in item.content if p.type not in _TEXT_PARTS]
            if parts:
                raise ProtocolError("unsupported_on_twilio",
                              f"A message on a Twilio call carries text, not {parts[0].type}.",
                              "item.content")
            text = "".join(p.text or "" for p in item.content)
            push = EnginePushText(text, role=_ROLES[item.role])
            wire = {"type": "message", "role": item.role,
                    "content": [p.model_dump(exclude_none=True) for p in item.content]}
        out.append(push)
        wire = {"id": item.id or self.new_id("item"), "object": "realtime.item",
                "status": "completed", **wire}
        self.emit(out, "conversation.item.added", item=wire, previous_item_id=None)
        self.emit(out, "conversation.item.done", item=wire, previous_item_id=None)

    # -- what the call does -------------------------------------------------------------------

    def started(self, out: list, e: ev.ResponseStarted) -> None:
        r = _Reply(self.new_id("resp"), self.new_id("item"))
        self._replies[e.response_id] = r
        self.emit(out, "response.created", response=self._response(r, "in_progress", None, ""))
        self.emit(out, "response.output_item.added", response_id=r.id, output_index=0,
                  item=self._message(r, "in_progress", ""))

    def ended(self, out: list, response_id: int, transcript: str,
              cancelled: str | None = None) -> None:
        """The reply is done: all of it generated and sent, or `cancelled` for that reason
        (its transcript then what the caller heard of it)."""
        r = self._replies.pop(response_id, None)
        if r is None:
            return
        status = "completed" if cancelled is None else "cancelled"
        message = self._message(r, "completed" if cancelled is None else "incomplete",
                                transcript)
        self.emit(out, "response.output_audio_transcript.done", response_id=r.id,
                  item_id=r.message_id, output_index=0, content_index=0, transcript=transcript)
        self.emit(out, "response.output_item.done", response_id=r.id, output_index=0,
                  item=message)
        details = None if cancelled is None else {"type": "cancelled", "reason": cancelled}
        self.emit(out, "response.done", response=self._response(r, status, details, transcript))

    def tool_call(self, out: list, response_id: int, piece) -> None:
        """A call the model is writing: its item once named, its arguments, its end."""
        r = self._replies.get(response_id)
        if r is None:
            return
        call = r.calls.get(piece.index)
        if call is None:
            call = {"id": self.new_id("item"), "object": "realtime.item",
                    "type": "function_call", "status": "in_progress",
                    "call_id": self.new_id("call"), "name": getattr(piece, "name", ""),
                    "arguments": ""}
            r.calls[piece.index] = call
            self.call_ids.add(call["call_id"])
            self.emit(out, "response.output_item.added", response_id=r.id,
                      output_index=len(r.calls), item=dict(call))
        where = {"response_id": r.id, "item_id": call["id"],
                 "output_index": 1 + list(r.calls).index(piece.index),
                 "call_id": call["call_id"]}
        if isinstance(piece, CallArguments):
            call["arguments"] += piece.delta
            self.emit(out, "response.function_call_arguments.delta", **where, delta=piece.delta)
        elif isinstance(piece, CallDone):
            call.update(name=piece.name, arguments=piece.arguments, status="completed")
            self.emit(out, "response.function_call_arguments.done", **where, name=piece.name,
                      arguments=piece.arguments)
            self.emit(out, "response.output_item.done", response_id=r.id,
                      output_index=where["output_index"], item=dict(call))
        elif not isinstance(piece, CallStarted):
            raise TypeError(f"not a piece of a call: {type(piece).__name__}")

    def speech(self, out: list, type_: str, at_sample: int, rate: int) -> None:
        """input_audio_buffer.speech_started / speech_stopped, at the call's clock."""
        key = "audio_start_ms" if type_.endswith("started") else "audio_end_ms"
        self.emit(out, f"input_audio_buffer.{type_}", item_id=None,
                  **{key: at_sample * 1000 // rate})

    def _message(self, r: _Reply, status: str, transcript: str) -> dict[str, Any]:
        return {"id": r.message_id, "object": "realtime.item", "type": "message",
                "status": status, "role": "assistant",
                "content": [{"type": "output_audio", "transcript": transcript}]}

    def _response(self, r: _Reply, status: str, details: dict[str, Any] | None,
                  transcript: str) -> dict[str, Any]:
        done = status != "in_progress"
        output = ([self._message(r, "completed" if status == "completed" else "incomplete",
                                 transcript), *(dict(c) for c in r.calls.values())]
                  if done else [])
        return {"id": r.id, "object": "realtime.response", "status": status,
                "status_details": details, "output": output,
                "conversation_id": "conv_" + self.session_id, "output_modalities": ["audio"],
                "max_output_tokens": self.settings.max_output_tokens, "metadata": None,
                "usage": None,
                "audio": {"output": {"format": {"type": "audio/pcmu"}, "voice": None}}}
