"""The conversation items a client handles: create (messages with text, audio or an image;
function calls and their outputs; answers to MCP approval requests), delete, retrieve, and
truncate (an assistant's audio cut where the listener stopped hearing it, with its
transcript)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable

from pydantic import ValidationError

from duplex.media.rates import REALTIME_RATE as RATE
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.session.errors import SessionError
from duplex.transport.core import MediaClock
from duplex.transport.effects import EnginePushImage, EnginePushText
from duplex.transport.realtime import schema
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.realtime.events import EventWriter
from duplex.transport.realtime.input_audio import InputAudio
from duplex.transport.realtime.mcp import McpTools
from duplex.transport.realtime.replies import Replies


class Items:
    def __init__(self, clock: MediaClock, events: EventWriter, conversation: Conversation,
                 input_audio: InputAudio, replies: Replies,
                 cancel: Callable[[list, str], None], mcp: McpTools) -> None:
        self.clock = clock
        self.core = clock.core
        self.events = events
        self.conversation = conversation
        self.input = input_audio
        self.replies = replies
        self.cancel = cancel
        self.mcp = mcp

    def _find(self, item_id: str) -> Item:
        item = self.conversation.find(item_id)
        if item is None:
            raise ProtocolError("item_not_found", f"Item '{item_id}' does not exist.", "item_id")
        return item

    def create(self, out: list, event: schema.ItemCreate) -> None:
        kind = event.item.get("type", "message")
        model = schema.ITEM_TYPES.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ProtocolError("invalid_value",
                                f"Invalid value for 'item.type': {kind!r} is not one of "
                                f"{', '.join(schema.ITEM_TYPES)}.", "item.type")
        try:
            item = model.model_validate(event.item)
        except ValidationError as exc:
            raise ProtocolError("invalid_value", *reversed(schema.first_problem(exc, "item."))) from None
        after = event.previous_item_id
        if after not in (None, "root") and self.conversation.find(after) is None:
            raise ProtocolError("item_not_found", f"Item '{after}' does not exist.",
                                "previous_item_id")
        item_id = item.id or self.events.new_id("item")
        if self.conversation.find(item_id):
            raise ProtocolError("item_already_exists", f"Item '{item_id}' already exists.", "item.id")
        if isinstance(item, schema.MessageItem):
            record = self._message(out, item_id, item)
        elif isinstance(item, schema.FunctionCallItem):
            record = Item(item_id, type="function_call", call_id=item.call_id, name=item.name,
                          arguments=item.arguments)
        elif isinstance(item, schema.McpApprovalResponseItem):
            self.mcp.check_approval(item.approval_request_id)
            record = Item(item_id, type="mcp_approval_response",
                          approval_request_id=item.approval_request_id, approve=item.approve,
                          reason=item.reason)
        else:
            if not any(i.type == "function_call" and i.call_id == item.call_id
                       for i in self.conversation):
                raise ProtocolError("invalid_value",
                                    f"Invalid value for 'item.call_id': no function call with "
                                    f"call_id '{item.call_id}' in the conversation.",
                                    "item.call_id")
            record = Item(item_id, type="function_call_output", call_id=item.call_id,
                          output=item.output)
            out.append(EnginePushText(item.output, role="tool"))
        previous = self.conversation.insert(record, after)
        self.events.emit(out, "conversation.item.added", item=record.as_wire(),
                         previous_item_id=previous)
        self.events.emit(out, "conversation.item.done", item=record.as_wire(),
                         previous_item_id=previous)
        if record.type == "mcp_approval_response":
            self.mcp.on_approval(out, record, self.replies.active)

    def _message(self, out: list, item_id: str, item: schema.MessageItem) -> Item:
        first = item.content[0] if item.content else None
        if first is None:
            raise ProtocolError("invalid_value", "An item needs at least one content part.",
                                "item.content")
        if first.type == "input_audio":
            if first.audio is None:
                raise ProtocolError("missing_required_parameter",
                                    "Missing required parameter: 'item.content[0].audio'.",
                                    "item.content.0.audio")
            self.input.append_base64(out, first.audio, "item.content.0.audio")
            record = Item(item_id, role=item.role, content_type=first.type,
                          transcript=first.transcript)
            self.input.transcribe(out, record)
            return record
        elif first.type == "input_image":
            out.append(EnginePushImage(_image_bytes(first.image_url)))
        elif first.type in ("input_text", "text") and item.role == "user" and first.text:
            out.append(EnginePushText(first.text))
        return Item(item_id, role=item.role, content_type=first.type, text=first.text,
                    transcript=first.transcript)

    def delete(self, out: list, event: schema.ItemRef) -> None:
        item = self._find(event.item_id)
        self.conversation.remove(item)
        self.events.emit(out, "conversation.item.deleted", item_id=item.id)

    def retrieve(self, out: list, event: schema.ItemRef) -> None:
        self.events.emit(out, "conversation.item.retrieved",
                         item=self._find(event.item_id).as_wire())

    def truncate(self, out: list, event: schema.ItemTruncate) -> None:
        item = self.conversation.find(event.item_id)
        if item is None or item.response_id is None or item.content_type != "output_audio":
            raise ProtocolError("item_not_found",
                                f"No assistant audio item '{event.item_id}' to truncate.", "item_id")
        if event.content_index != 0:
            raise ProtocolError("invalid_value", "Only content_index 0 holds audio.", "content_index")
        active = self.replies.active
        if active is not None and active.item is item:
            self.cancel(out, "client_cancelled")
        end = event.audio_end_ms * RATE // 1000
        try:
            events = self.core.handle(cmd.Truncate(item.response_id, end))
        except SessionError as exc:
            raise ProtocolError("invalid_value", f"Invalid value for 'audio_end_ms': {exc}.",
                                "audio_end_ms") from None
        for e in events:
            if isinstance(e, ev.TranscriptTruncated):
                item.transcript = e.heard_text
        self.clock.pacer.rewind(self.core.sent_samples)
        self.events.emit(out, "conversation.item.truncated", item_id=item.id, content_index=0,
                         audio_end_ms=event.audio_end_ms)


def _image_bytes(image_url: str | None) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; fetching URLs is not something we do."""
    if not image_url:
        raise ProtocolError("missing_required_parameter",
                            "Missing required parameter: 'item.content[0].image_url'.",
                            "item.content.0.image_url")
    head, _, payload = image_url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ProtocolError("invalid_value",
                            "Invalid value for 'image_url': only data:image/...;base64 URLs are "
                            "accepted.", "item.content.0.image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_value", "Invalid value for 'image_url': not valid base64.",
                            "item.content.0.image_url") from None
