"""The output side of a Realtime session: the reply being generated and played, and every
event of its life: created, its item and content part, audio and text deltas released at
real time, done, cancelled (a barge-in or the client), failed.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

import numpy as np

from duplex.engine.thinker_text import CallArguments, CallDone, Piece
from duplex.media import Resampler, float_to_g711, float_to_pcm16
from duplex.media.rates import REALTIME_RATE as RATE
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.transport.core import MediaClock
from duplex.transport.effects import (
    EngineCommit,
    FlushAudio,
    HoldAudio,
    InvalidToolCall,
    PlayAudio,
    ResumeAudio,
)
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.events import ActiveResponse, EventWriter
from duplex.transport.realtime.mcp import McpTools
from duplex.transport.realtime.model_context import ModelContext
from duplex.transport.realtime.session_config import ResponseSettings, Voices

G711_LAWS = {"audio/pcmu": "ulaw", "audio/pcma": "alaw"}


class Replies:
    def __init__(self, clock: MediaClock, events: EventWriter, conversation: Conversation,
                 voices: Voices, mcp: McpTools, context: ModelContext, *, media_track: bool,
                 conversation_id: str) -> None:
        self.clock = clock
        self.mcp = mcp
        """The session's MCP tools: offered to each reply, run when it calls them."""
        self.context = context
        self.core = clock.core
        self.events = events
        self.conversation = conversation
        self.media_track = media_track
        """Reply audio goes to a paced media track (WebRTC) instead of audio delta events."""
        self.conversation_id = conversation_id
        self.voices = voices
        self.active: ActiveResponse | None = None
        self._g711_out = Resampler(RATE, 8000)

    def _wire(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.events.response_object(self.active, status, details, self.conversation_id)

    def start(self, out: list, settings: ResponseSettings, *, commit: bool = True) -> None:
        """Begin a reply; `commit` asks the engine for it (a duplex model began it itself)."""
        settings = self.mcp.resolve(settings)
        events = self.core.handle(cmd.StartResponse())
        started = next(e for e in events if isinstance(e, ev.ResponseStarted))
        # The engine is told of the edits before the reply, and the reply starts its own unit.
        unit = self.context.begin_reply(out) if commit else None
        new_id = self.events.new_id
        if settings.audio:
            item = Item(new_id("item"), role="assistant", content_type="output_audio",
                        transcript="", status="in_progress", response_id=started.response_id,
                        unit=unit)
            part = {"type": "audio", "transcript": ""}
        else:
            item = Item(new_id("item"), role="assistant", content_type="output_text", text="",
                        status="in_progress", response_id=started.response_id, unit=unit)
            part = {"type": "text", "text": ""}
        self.active = r = ActiveResponse(new_id("resp"), started.response_id, started.epoch,
                                         item, settings)
        # A duplex model's frames keep its own clock: they play as they come.
        self.clock.tempo.start(settings.speed if commit else 1.0)
        emit = self.events.emit
        emit(out, "response.created", response=self._wire("in_progress"))
        if settings.conversation != "none":
            previous = self.conversation.append(item)
            emit(out, "conversation.item.added", item=item.as_wire(), previous_item_id=previous)
        emit(out, "response.output_item.added", response_id=r.id, output_index=0,
             item=item.as_wire())
        emit(out, "response.content_part.added", response_id=r.id, item_id=item.id,
             output_index=0, content_index=0, part=part)
        if commit:
            spec = replace(settings.spec(), voice=self.voices.for_model(settings.voice))
            out.append(EngineCommit(started.epoch, spec))

    def cancel(self, out: list, reason: str) -> None:
        if self.active is not None:
            self.apply_core_events(out, self.core.handle(cmd.Cancel(reason)))

    def apply_core_events(self, out: list, events: list[ev.Event]) -> None:
        emit = self.events.emit
        for e in events:
            out += self.clock.cancel_effects(e)
            if isinstance(e, ev.Flush) and self.media_track:
                out.append(FlushAudio())
            elif isinstance(e, ev.OutputPaused) and self.media_track:
                # What the track holds stops too, not only what would come next.
                out.append(HoldAudio())
            elif isinstance(e, ev.OutputResumed) and self.media_track:
                out.append(ResumeAudio())
            elif isinstance(e, ev.TranscriptTruncated):
                record = self.item_of_core(e.response_id)
                if record is not None:
                    record.set_spoken(e.heard_text)
            elif isinstance(e, ev.ResponseCancelled) and self.active is not None:
                r = self.active
                for item in r.output():
                    if item.status == "in_progress":
                        item.status = "incomplete"
                emit(out, "response.output_item.done", response_id=r.id, output_index=0,
                     item=r.item.as_wire())
                if r.settings.conversation != "none":
                    emit(out, "conversation.item.done", item=r.item.as_wire())
                reason = "turn_detected" if e.reason == "barge_in" else e.reason
                emit(out, "response.done", response=self._wire(
                    "cancelled", {"type": "cancelled", "reason": reason, "error": None}))
                emit(out, "output_audio_buffer.cleared", response_id=r.id)
                self.active = None
        self.clock.settle()

    def item_of_core(self, core_id: int) -> Item | None:
        r = self.active
        if r is not None and r.core_id == core_id:
            return r.item
        return self.conversation.of_response(core_id)

    # -- engine results -------------------------------------------------------------------

    def on_audio(self, epoch: int, pcm: np.ndarray, text: str) -> None:
        r = self.active
        if r is None or epoch != r.epoch:
            return
        for audio, piece in self.clock.reply_pieces(pcm, text):
            self._produced(epoch, audio, piece)

    def on_finished(self, epoch: int, reason: str, usage: dict | None = None) -> None:
        r = self.active
        if r is not None and epoch == r.epoch:
            r.usage = usage
            for audio, piece in self.clock.reply_end():
                if len(audio) or piece:
                    self._produced(epoch, audio, piece)
            r.engine_done = True
            r.finish_reason = reason

    def on_text(self, out: list, epoch: int, text: str) -> None:
        """Text of a text-only reply: sent as written, there is no audio to pace it by."""
        r = self.active
        if r is None or epoch != r.epoch:
            return
        r.transcript.append(text)
        self.events.emit(out, "response.output_text.delta", response_id=r.id, item_id=r.item.id,
                         output_index=0, content_index=0, delta=text)

    def on_tool_call(self, out: list, epoch: int, piece: Piece) -> None:
        """A call the model is writing: its item appears once named, its arguments stream,
        and it is done (a function call with the raw text as arguments if it was not JSON;
        an MCP tool's call is run, mcp.py)."""
        r = self.active
        if r is None or epoch != r.epoch:
            return
        item = r.calls.get(piece.index)
        if item is None:
            item = self._new_call(out, r, piece.index, getattr(piece, "name", ""))
        output_index = 1 + list(r.calls).index(piece.index)
        if item.type != "function_call":
            self.mcp.on_piece(out, r, item, output_index, piece)
            return
        where = {"response_id": r.id, "item_id": item.id, "output_index": output_index,
                 "call_id": item.call_id}
        if isinstance(piece, CallArguments):
            item.arguments += piece.delta
            self.events.emit(out, "response.function_call_arguments.delta", **where,
                             delta=piece.delta)
        elif isinstance(piece, CallDone):
            item.name, item.arguments, item.status = piece.name, piece.arguments, "completed"
            if not piece.valid:
                out.append(InvalidToolCall(piece.name, piece.arguments))
            self.events.emit(out, "response.function_call_arguments.done", **where,
                             name=item.name, arguments=item.arguments)
            self.events.emit(out, "response.output_item.done", response_id=r.id,
                             output_index=output_index, item=item.as_wire())
            if r.settings.conversation != "none":
                self.events.emit(out, "conversation.item.done", item=item.as_wire())

    def _new_call(self, out: list, r: ActiveResponse, index: int, name: str) -> Item:
        item = self.mcp.new_call(r, name) or Item(
            self.events.new_id("item"), type="function_call", status="in_progress",
            call_id=self.events.new_id("call"), name=name, arguments="", unit=r.item.unit)
        r.calls[index] = item
        output_index = len(r.calls)
        if r.settings.conversation != "none":
            previous = self.conversation.append(item)
            self.events.emit(out, "conversation.item.added", item=item.as_wire(),
                             previous_item_id=previous)
        self.events.emit(out, "response.output_item.added", response_id=r.id,
                         output_index=output_index, item=item.as_wire())
        return item

    def _produced(self, epoch: int, audio: np.ndarray, text: str) -> None:
        for e in self.core.handle(cmd.OutputChunkProduced(epoch, len(audio), text)):
            if isinstance(e, ev.OutputChunk):
                self.clock.pacer.push(e, audio)

    def fail(self, out: list) -> None:
        if self.active is not None:
            self.clock.pacer.flush()
            self.active.item.status = "incomplete"
            self.events.emit(out, "response.done", response=self._wire("failed", {
                "type": "failed", "reason": None,
                "error": {"type": "server_error", "code": "model_error"}}))
            self.active = None

    # -- release at real time ---------------------------------------------------------------

    def release(self, out: list, now: int) -> None:
        """Send the reply audio due at clock sample `now`; finish a reply fully sent."""
        for chunk, audio in self.clock.due(now):
            self._send_chunk(out, chunk, audio)
        played = self.clock.pacer.played(now)
        if played > self.core.played_samples:
            self.core.handle(cmd.PlaybackAcknowledged(played))
        r = self.active
        if r is not None and r.engine_done and not self.clock.pacer and not r.pending:
            self._finish(out)

    def _send_chunk(self, out: list, chunk: ev.OutputChunk, audio: np.ndarray) -> None:
        self.clock.guard.played(chunk.start_sample, audio)
        r = self.active
        where = {"response_id": r.id, "item_id": r.item.id, "output_index": 0, "content_index": 0}
        if r.settings.audio and self.media_track:
            if not r.audio_started:
                r.audio_started = True
                self.events.emit(out, "output_audio_buffer.started", response_id=r.id)
            out.append(PlayAudio(chunk.start_sample, audio))
        elif r.settings.audio and len(audio):
            self.events.emit(out, "response.output_audio.delta", **where,
                             delta=base64.b64encode(self._encode(audio)).decode())
        if chunk.text:
            r.transcript.append(chunk.text)
            text_event = ("response.output_audio_transcript.delta" if r.settings.audio
                          else "response.output_text.delta")
            self.events.emit(out, text_event, **where, delta=chunk.text)

    def _encode(self, audio: np.ndarray) -> bytes:
        fmt = self.active.settings.output_format
        if fmt == "audio/pcm":
            return float_to_pcm16(audio)
        return float_to_g711(self._g711_out.process(audio), G711_LAWS[fmt])

    def _finish(self, out: list) -> None:
        r = self.active
        emit = self.events.emit
        self.core.handle(cmd.ResponseCompleted(r.epoch))
        spoken = "".join(r.transcript)
        r.item.set_spoken(spoken)
        r.item.status = "completed" if r.finish_reason == "completed" else "incomplete"
        where = {"response_id": r.id, "item_id": r.item.id, "output_index": 0, "content_index": 0}
        if r.settings.audio:
            emit(out, "response.output_audio.done", **where)
            emit(out, "response.output_audio_transcript.done", **where, transcript=spoken)
            part = {"type": "audio", "transcript": spoken}
        else:
            emit(out, "response.output_text.done", **where, text=spoken)
            part = {"type": "text", "text": spoken}
        emit(out, "response.content_part.done", **where, part=part)
        emit(out, "response.output_item.done", response_id=r.id, output_index=0,
             item=r.item.as_wire())
        if r.settings.conversation != "none":
            emit(out, "conversation.item.done", item=r.item.as_wire())
        if r.finish_reason == "completed":
            emit(out, "response.done", response=self._wire("completed"))
        elif r.finish_reason == "context_length_exceeded":
            emit(out, "response.done", response=self._wire("failed", {
                "type": "failed", "reason": None,
                "error": {"type": "invalid_request_error", "code": "context_length_exceeded",
                          "message": "The conversation exceeds the model's context and "
                                     "truncation is disabled."}}))
        elif r.finish_reason == "server_full":
            emit(out, "response.done", response=self._wire("failed", {
                "type": "failed", "reason": None,
                "error": {"type": "server_error", "code": "server_full",
                          "message": "The server's KV memory has no room for this reply beside "
                                     "what other sessions hold; try again shortly."}}))
        else:
            emit(out, "response.done", response=self._wire(
                "incomplete", {"type": "incomplete", "reason": r.finish_reason, "error": None}))
        if self.media_track and r.audio_started:
            emit(out, "output_audio_buffer.stopped", response_id=r.id)
        self.active = None
        self.mcp.reply_done(out, r)
