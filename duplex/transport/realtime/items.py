"""The conversation items a client handles: create (messages of any role with text, audio and
images in order; function calls and their outputs; answers to MCP approval requests), delete,
retrieve, and truncate (an assistant's audio cut where the listener stopped hearing it, with
its transcript). What an item lays into the model's context goes through `ModelContext`, in
the item's place."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable

import numpy as np
from pydantic import ValidationError

from duplex.media import Resampler
from duplex.media.rates import REALTIME_RATE as RATE
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.session.errors import SessionError
from duplex.transport.core import MediaClock
from duplex.transport.effects import EnginePush, EnginePushImage, EnginePushText
from duplex.transport.realtime import schema
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.realtime.events import EventWriter
from duplex.transport.realtime.input_audio import InputAudio
from duplex.transport.realtime.mcp import McpTools
from duplex.transport.realtime.model_context import ModelContext
from duplex.transport.realtime.replies import Replies


class Items:
    def __init__(self, clock: MediaClock, events: EventWriter, conversation: Conversation,
                 input_audio: InputAudio, replies: Replies, context: ModelContext,
                 cancel: Callable[[list, str], None], model_input_rate: int,
                 mcp: McpTools) -> None:
        self.clock = clock
        self.context = context
        self.model_input_rate = model_input_rate
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
            raise ProtocolError("item_create_duplicate_item_id",
                                f"Item with id '{item_id}' already exists in the conversation.",
                                "item.id")
        pushes: list = []
        heard: list[np.ndarray] = []
        if isinstance(item, schema.MessageItem):
            record = self._message(pushes, heard, item_id, item)
        elif isinstance(item, schema.FunctionCallItem):
            record = Item(item_id, type="function_call", call_id=item.call_id, name=item.name,
                          arguments=item.arguments)
            pushes.append(EnginePushText(
                json.dumps({"name": item.name, "arguments": item.arguments}), "function_call"))
        elif isinstance(item, schema.McpApprovalResponseItem):
            record = Item(item_id, type="mcp_approval_response",
                          approval_request_id=item.approval_request_id, approve=item.approve,
                          reason=item.reason)
            pushes += self.mcp.answered(record)
        else:
            if not any(i.type == "function_call" and i.call_id == item.call_id
                       for i in self.conversation):
                raise ProtocolError("invalid_tool_call_id",
                                    f"Tool call ID '{item.call_id}' not found in conversation.",
                                    "item.call_id")
            record = Item(item_id, type="function_call_output", call_id=item.call_id,
                          output=item.output)
            pushes.append(EnginePushText(item.output, role="tool"))
        record.unit = self.context.lay(out, pushes)
        previous = self.conversation.insert(record, after)
        self.events.emit(out, "conversation.item.added", item=record.as_wire(),
                         previous_item_id=previous)
        self.events.emit(out, "conversation.item.done", item=record.as_wire(),
                         previous_item_id=previous)
        if heard:
            self.input.transcribe_item(out, record, np.concatenate(heard))
        if record.type == "mcp_approval_response":
            self.mcp.on_approval(out, record, self.replies.active)

    def _message(self, pushes: list, heard: list[np.ndarray], item_id: str,
                 item: schema.MessageItem) -> Item:
        """The message's record; into `pushes` the input it lays into the model's context (a
        user's parts in order, a system or assistant message as a turn of its own), into
        `heard` a user's audio (24 kHz) for transcription."""
        if not item.content:
            raise ProtocolError("invalid_value", "An item needs at least one content part.",
                                "item.content")
        role = "system" if item.role == "developer" else item.role
        parts: list[dict] = []
        said: list[str] = []
        for i, part in enumerate(item.content):
            param = f"item.content.{i}"
            if part.type == "input_audio":
                if part.audio is None:
                    raise ProtocolError("missing_required_parameter",
                                        f"Missing required parameter: '{param}.audio'.",
                                        f"{param}.audio")
                pcm = self.input.decode_item_audio(part.audio, f"{param}.audio")
                if role == "user":
                    pushes.append(EnginePush(Resampler(RATE, self.model_input_rate).process(
                        pcm, last=True)))
                    heard.append(pcm)
                parts.append({"type": "input_audio", "transcript": part.transcript})
            elif part.type == "input_image":
                data = _image_bytes(part.image_url, f"{param}.image_url")
                if role == "user":
                    pushes.append(EnginePushImage(data))
                parts.append({"type": "input_image", "image_url": part.image_url})
            else:
                text = part.text if part.type not in ("output_audio", "audio") else part.transcript
                if role == "user" and text:
                    pushes.append(EnginePushText(text))
                said.append(text or "")
                key = "transcript" if part.type in ("output_audio", "audio") else "text"
                parts.append({"type": part.type, key: text})
        if role != "user" and "".join(said):
            pushes.append(EnginePushText("".join(said), role))
        first = item.content[0]
        return Item(item_id, role=item.role, content_type=first.type, text=first.text,
                    transcript=first.transcript, content=parts)

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


def _image_bytes(image_url: str | None, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; fetching URLs is not something we do."""
    if not image_url:
        raise ProtocolError("missing_required_parameter",
                            f"Missing required parameter: '{param}'.", param)
    head, _, payload = image_url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ProtocolError("invalid_value",
                            f"Invalid value for '{param}': only data:image/...;base64 URLs are "
                            "accepted.", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_value", f"Invalid value for '{param}': not valid base64.",
                            param) from None
