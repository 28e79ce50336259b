"""One Realtime session on any carrier: the WebSocket endpoint, the WebRTC data channel and the
benchmark's in-process clients all run this same loop around the pure Realtime core, with
what only a Realtime session has: media tracks, resume and its registry keeper, quotas,
per-stage timings, input transcription, metrics.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from duplex.access.limits import Place, Quota
from duplex.engine.client import EngineClient
from duplex.engine.scheduler import ReplyTokens, ResponseFinished, ResponseTimings
from duplex.media.image import decode_image
from duplex.observability.logs import bind_session
from duplex.observability.metrics import Metrics
from duplex.store import ResumeError, SessionRegistry, StoredContext
from duplex.store.context import (
    AudioSpan,
    ContextRecord,
    ImageSpan,
    MarkSpan,
    Rebuilt,
    ReplySpan,
    TextSpan,
    from_pcm16,
    quantize,
)
from duplex.store.keeper import SessionKeeper
from duplex.store.live import Parked
from duplex.transcription.service import (
    RECOGNITION_FAILED,
    TranscriptionError,
    TranscriptionResult,
)
from duplex.transport.effects import (
    EngineClearInput,
    EngineCommit,
    EngineInstruct,
    EngineMark,
    EnginePush,
    EnginePushFrame,
    EnginePushImage,
    EnginePushText,
    EngineReplay,
    EngineRewind,
    FlushAudio,
    HoldAudio,
    InterruptionJudged,
    InvalidToolCall,
    PlayAudio,
    ResumeAudio,
)
from duplex.transport.inbox import (
    EngineOutput,
    Fenced,
    McpCalled,
    McpListed,
    MediaAudio,
    MediaFrame,
    Message,
    PeerBytes,
    PeerText,
    Tick,
    TranscriptReady,
)
from duplex.transport.loop import SessionLoop
from duplex.transport.realtime import mcp_client
from duplex.transport.realtime.mcp import CallTool, ListTools
from duplex.transport.realtime.protocol import (
    RATE,
    Limits,
    RealtimeProtocol,
    ResumeSession,
    Transcribe,
)
from duplex.transport.realtime.session_config import Voices
from models.base import ReplyTurn

if TYPE_CHECKING:
    from duplex.engine.vad import VadService
    from duplex.transcription import Transcriber

log = logging.getLogger("duplex.realtime")
# Events after which the conversation (or its settings) changed: saved at once, not at the
# next heartbeat.
_SAVE_AFTER = frozenset({
    "session.updated", "conversation.item.done", "conversation.item.truncated",
    "conversation.item.deleted", "response.done", "conversation.item.created",
})
_NO_TRANSCRIBER = TranscriptionResult("", "", 0.0, TranscriptionError(
    RECOGNITION_FAILED, "This server runs no speech recogniser."))


class RealtimeSession(SessionLoop):
    """One Realtime session on any carrier: frames go in through `inbox`, events out through
    `send_text`. The WebSocket endpoint, the WebRTC data channel and the benchmark's in-process
    clients all run this same loop.
    """

    rate = RATE

    def __init__(self, engine: EngineClient, vad: VadService, limits: Limits, model_name: str,
                 send_text, *, beta: bool = False, session_id: str | None = None,
                 media=None, video_interval_samples: int = RATE // 2,
                 registry: SessionRegistry | None = None, heartbeat_s: float = 2.0,
                 quota: Quota | None = None, metrics: Metrics | None = None,
                 duplex_events: bool = False, transcriber: Transcriber | None = None,
                 duplex_default: bool = False, place: Place | None = None) -> None:
        # This connection's name in the engine and hub; a resume changes only the protocol's
        # (the registry's) id, so the same session resumed on this node never collides.
        session_id = session_id or "sess_" + secrets.token_hex(8)
        token = None
        if registry is not None:
            lease, token = registry.new_lease(session_id)
        protocol = RealtimeProtocol(
            session_id,
            model=model_name,
            model_input_rate=engine.model.input_rate,
            model_output_rate=engine.model.output_rate,
            beta=beta,
            limits=limits,
            media_track=media is not None,
            video_interval_samples=video_interval_samples,
            resume_token=token,
            duplex_events=duplex_events,
            voices=Voices(engine.model.voices, engine.model.default_voice),
            transcription_models=transcriber.names if transcriber is not None else (),
            transcription_languages=(transcriber.languages if transcriber is not None
                                     else lambda model: None),
            native_duplex=engine.model.duplex_delay_frames is not None,
            rewinds_context=engine.model.rewinds_context,
            start_duplex=duplex_default,
            turn_model=vad.turn_end is not None,
        )
        super().__init__(engine, vad, send_text, session_id, protocol)
        protocol.more_waiting = lambda: self.inbox.qsize() > 0
        self.media = media
        """A media track (WebRTC) with play(start_sample, pcm), hold(), resume() and flush();
        None for events."""
        self.mcp_timeout_s = limits.mcp_timeout_s
        self._mcp_work: set[asyncio.Task] = set()
        """MCP listings and calls under way; cancelled when the session ends."""
        self.quota = quota
        self.metrics = metrics
        self.transcriber = transcriber
        self.place = place
        """This connection's seat in the session limits; a resume moves it onto the session's."""
        self._response_started: float | None = None
        self._onset: int | None = None
        self.keeper = None
        self.context: ContextRecord | None = None
        """The model's context as heard: what an edit of the conversation lays again (models
        that rewind theirs), and what a resume rebuilds on another node (with a registry)."""
        self._cut: dict[int, list] = {}
        """What the last rewind took out of the context, by unit, to lay again."""
        if registry is not None:
            self.keeper = SessionKeeper(registry, lease, self._snapshot,
                                        lambda: self.inbox.put(Fenced()), heartbeat_s)
        if engine.model.restores_context and (registry is not None
                                              or engine.model.rewinds_context):
            self.context = self._new_context()

    def _new_context(self, saved: StoredContext | None = None) -> ContextRecord:
        m = self.engine.model
        cap = self.keeper.registry.context_max_bytes if self.keeper is not None else 0
        args = (m.input_rate, m.output_rate, RATE, cap)
        if saved is None:
            return ContextRecord(*args)
        return ContextRecord.from_record(saved, *args)

    def _snapshot(self) -> tuple[list, dict, StoredContext]:
        now = self.now_sample()
        items, config = self.protocol.snapshot(now)
        context = StoredContext() if self.context is None else self.context.to_record(
            lambda core_id: self.protocol.heard(core_id, now), self.protocol.input_state())
        return items, config, context

    def feed_audio(self, pcm) -> None:
        """Float32 mono at 24 kHz from a media track."""
        self.inbox.put(MediaAudio(pcm))

    def feed_frame(self, frame, pts_sample: int) -> None:
        """A camera frame whose time on the input clock is `pts_sample` (24 kHz)."""
        self.inbox.put(MediaFrame(frame, pts_sample))

    async def started(self) -> bool:
        bind_session(self.protocol.session_id,
                     self.keeper.lease.epoch if self.keeper is not None else None)
        if self.keeper is not None:
            await self.keeper.start()
        return await self.execute(self.protocol.start())

    def release_engine(self) -> None:
        """A connection that dropped (nobody closed the session on purpose) leaves its engine
        state on this node a while, for a resume here to take over."""
        live = self.keeper.registry.live if self.keeper is not None else None
        if live is None or not live.keep_s or self.close_code is not None or self.keeper.fenced:
            super().release_engine()
            return
        engine, engine_id = self.engine, self.engine_id
        # The reply that was playing ends here; the new connection starts past its epoch.
        epoch = self.protocol.core.epoch + 1
        engine.cancel(engine_id, epoch)
        engine.park(engine_id)
        live.park(self.protocol.session_id, Parked(engine_id, self.keeper.lease.epoch, epoch,
                                                   lambda: engine.close(engine_id),
                                                   self.protocol.input_state()))

    async def ended(self) -> None:
        for task in self._mcp_work:
            task.cancel()
        if self.keeper is not None:
            await self.keeper.stop()
        held = self.protocol.close()
        if self.metrics is not None:
            for track, counters in self.protocol.core.tracks.items():
                for reason, n in counters.dropped.items():
                    self.metrics.dropped.labels(track, reason).inc(n)
        log.info("session %s closed; released %s", self.session_id, held)

    def dispatch(self, message: Message) -> list:
        own = _MESSAGES.get(type(message))
        if own is not None:
            return own(self, message)
        if isinstance(message, (PeerText, PeerBytes)) and self.quota is not None \
                and (wait := self.quota.take()):
            return self.protocol.refuse(
                "rate_limit_exceeded",
                f"Too many messages: this one was dropped. Retry in {wait:.2f} s.")
        if isinstance(message, Tick) and self._past_duration():
            return self.protocol.end("session_duration_exceeded",
                                     f"Sessions last at most {self.quota.max_session_s:g} s "
                                     "(limits.max_session_s).", 1008, "session duration limit")
        return super().dispatch(message)

    async def execute(self, effects) -> bool:
        if self.context is not None:
            effects = [self._record(e) for e in effects]
        return await super().execute(effects)

    def _record(self, effect):
        """Keep what reaches the model's context; audio onto the 16-bit grid first, so the
        model hears exactly what is kept."""
        c = self.context
        if isinstance(effect, EnginePush):
            effect = EnginePush(quantize(effect.pcm))
            c.audio(effect.pcm)
        elif isinstance(effect, EnginePushText):
            c.text(effect.text, effect.role)
        elif isinstance(effect, EngineInstruct):
            c.instruct(effect.instructions, effect.tools)
        elif isinstance(effect, EngineCommit) and self.protocol.response is not None:
            c.reply(self.protocol.response.core_id, effect.epoch, effect.spec.instructions,
                    effect.spec.tools, self.protocol.clock.tempo.speed)
        elif isinstance(effect, EngineClearInput):
            c.clear_input()
        elif isinstance(effect, EngineMark):
            c.mark(effect.key)
        elif isinstance(effect, EngineRewind):
            self._cut.update(c.rewind(effect.key))
            if effect.system is not None:
                c.instruct(*effect.system)
        elif isinstance(effect, EnginePushImage):
            c.image(effect.data)
        return effect

    def _engine_output(self, message: EngineOutput) -> list:
        t = message.event
        if isinstance(t, ReplyTokens):
            if self.context is not None:
                self.context.tokens(t.epoch, t.ids, t.media_start, t.start)
            return []
        if isinstance(t, ResponseFinished):
            return self.protocol.on_engine_finished(t.epoch, t.reason, t.usage)
        if isinstance(t, ResponseTimings):
            return self.protocol.on_engine_timings({
                "input": t.input_ms,
                "thinker_first_token": t.thinker_first_token_ms,
                "talker_first_codes": t.talker_first_codes_ms,
                "codec_first_audio": t.codec_first_audio_ms,
            })
        return super()._engine_output(message)

    def _fenced(self, message: Fenced) -> list:
        p = self.protocol
        return p.end("session_taken_over",
                     f"Session '{p.session_id}' was resumed on another connection; "
                     "this one no longer serves it.", 4409, "session taken over")

    def _transcript(self, message: TranscriptReady) -> list:
        r = message.result
        return self.protocol.on_transcript(message.item_id, r.text,
                                           r.error.message if r.error else None, r.audio_s,
                                           message.partial)

    async def _push_image(self, data: bytes) -> bool:
        """Decode off the event loop; a bad image is the client's error, the session goes on."""
        try:
            rgb = await asyncio.to_thread(decode_image, data)
        except ValueError as exc:
            return await self.execute(
                self.protocol.refuse("invalid_image", str(exc), "item.content.0.image_url")
            )
        self.engine.push_frame(self.engine_id, rgb)
        return False

    def sent(self, event: dict) -> None:
        if self.metrics is not None:
            self._observe(event)
        if self.keeper is not None and event["type"] in _SAVE_AFTER:
            self.keeper.touch()

    async def carry_out(self, effect) -> bool:
        sid = self.engine_id
        if isinstance(effect, EngineClearInput):
            self.engine.clear_input(sid)
        elif isinstance(effect, EnginePushFrame):
            frame = effect.frame
            rgb = frame.to_ndarray(format="rgb24") if hasattr(frame, "to_ndarray") else frame
            self.engine.push_frame(sid, rgb)
        elif isinstance(effect, EnginePushImage):
            return await self._push_image(effect.data)
        elif isinstance(effect, PlayAudio):
            self.media.play(effect.start_sample, effect.pcm)
        elif isinstance(effect, FlushAudio):
            self.media.flush()
        elif isinstance(effect, HoldAudio):
            self.media.hold()
        elif isinstance(effect, ResumeAudio):
            self.media.resume()
        elif isinstance(effect, ResumeSession):
            return await self.execute(await self._resume(effect))
        elif isinstance(effect, Transcribe):
            self._transcribe(effect)
        elif isinstance(effect, ListTools):
            self._mcp(mcp_client.list_tools(effect.server, self.mcp_timeout_s),
                      lambda result: McpListed(effect.item_id, *result))
        elif isinstance(effect, CallTool):
            self._mcp(mcp_client.call_tool(effect.server, effect.tool, effect.arguments,
                                           self.mcp_timeout_s),
                      lambda result: McpCalled(effect.item_id, *result))
        elif isinstance(effect, EngineMark):
            self.engine.mark(sid, effect.key)
        elif isinstance(effect, EngineRewind):
            self.engine.rewind(sid, effect.key, effect.system)
        elif isinstance(effect, EngineReplay):
            return await self._replay(effect.key)
        elif isinstance(effect, InterruptionJudged):
            if self.metrics is not None:
                self.metrics.count_interruption(effect.confirmed)
        elif isinstance(effect, InvalidToolCall):
            log.warning("session %s: the model wrote a tool call that is not JSON: %r",
                        self.session_id, effect.raw[:200])
            if self.metrics is not None:
                self.metrics.tool_calls_invalid.inc()
        else:
            return await super().carry_out(effect)
        return False

    def _mcp(self, work, message) -> None:
        """Talk to an MCP server alongside the session; its answer comes through the inbox."""

        async def run() -> None:
            self.inbox.put(message(await work))

        task = asyncio.create_task(run())
        self._mcp_work.add(task)
        task.add_done_callback(self._mcp_work.discard)

    async def _replay(self, key: int) -> bool:
        """Lay unit `key` again from what the last rewind took out (a reply as it was heard)."""
        spans = self._cut.pop(key, None)
        c, sid, engine = self.context, self.engine_id, self.engine
        if spans is None or c is None:
            return False
        c.mark(key)
        engine.mark(sid, key)
        now = self.now_sample()
        for span in spans:
            if isinstance(span, AudioSpan):
                pcm = from_pcm16(span.pcm())
                c.audio(pcm)
                engine.push_audio(sid, pcm)
            elif isinstance(span, TextSpan):
                c.text(span.text, span.role)
                engine.push_text(sid, span.text, span.role)
            elif isinstance(span, ImageSpan):
                c.image(span.data)
                if await self._push_image(span.data):
                    return True
            elif isinstance(span, ReplySpan):
                heard = self.protocol.heard(span.core_id, now) if span.core_id is not None else None
                ids = span.heard_ids(heard, c.scale)
                c.replayed_reply(span, ids)
                if ids:
                    engine.push_reply(sid, ReplyTurn(tuple(ids), span.instructions, span.tools))
        return False

    def _transcribe(self, effect: Transcribe) -> None:
        item_id, partial = effect.item_id, effect.partial
        if self.transcriber is None:
            self.inbox.put(TranscriptReady(item_id, _NO_TRANSCRIBER, partial))
            return
        self.transcriber.submit(
            effect.model, effect.pcm,
            lambda result: self.post(TranscriptReady(item_id, result, partial)), effect.hints)

    def _observe(self, event: dict) -> None:
        """Feed TTFA and barge-in latency (a barge-in's speech_started and its cleared come in
        one batch of effects)."""
        type_ = event["type"]
        if type_ == "response.created":
            self._response_started = time.monotonic()
        elif self._response_started is not None and (
            type_.endswith("audio.delta") or type_ == "output_audio_buffer.started"
        ):
            self.metrics.ttfa.observe(time.monotonic() - self._response_started)
            self._response_started = None
        elif type_ == "input_audio_buffer.speech_started":
            self._onset = event["audio_start_ms"] * RATE // 1000 + self.protocol.detector.prefix_samples
        elif type_ == "output_audio_buffer.cleared" and self._onset is not None:
            self.metrics.barge_in.observe(max(0, self.now_sample() - self._onset) / RATE)
            self._onset = None

    def _past_duration(self) -> bool:
        limit = self.quota.max_session_s if self.quota is not None else 0
        return bool(limit) and self.now_sample() >= limit * RATE

    async def _resume(self, effect: ResumeSession):
        if self.keeper is None:
            return self.protocol.refuse("session_not_found",
                                        "This server keeps no session registry.", "session_id")
        try:
            lease, record = await self.keeper.registry.resume(effect.session_id,
                                                              effect.resume_token)
        except ResumeError as exc:
            return self.protocol.refuse(exc.code, str(exc), "session_id")
        if self.place is not None:
            await self.place.move_to(record.id)
        # Nothing awaited from here to the return: the keeper's next save must see the resumed
        # session's context and conversation, never this connection's fresh ones under its id.
        await self.keeper.switch(lease, record.context or StoredContext())
        bind_session(record.id, lease.epoch)
        self.protocol.resume_token = effect.resume_token
        rebuilt = None
        parked = self.keeper.registry.live.take(record.id, lease.epoch)
        if parked is not None and self.engine.adopt(parked.engine_id, self.deliver):
            self.engine.close(self.engine_id)
            self.engine_id = parked.engine_id
            self.protocol.continue_epoch(parked.reply_epoch)
            context = self._new_context(record.context) if self.context is not None else None
            self.context = context
            rebuilt = (context.summary(kept_live=True) if context is not None
                       else Rebuilt(0, 0.0, 0, kept_live=True)).wire()
            if parked.resamplers is not None:
                self.protocol.resume_input(parked.resamplers)
        elif self.context is not None:
            self.context = self._new_context(record.context)
            rebuilt = self._rebuild(self.context).wire()
            if self.context.resamplers is not None:
                self.protocol.resume_input(self.context.resamplers)
        log.info("session %s resumed at epoch %d (connection %s); context put back: %s",
                 record.id, lease.epoch, self.session_id, rebuilt)
        units = self.context.units() if self.context is not None else []
        return self.protocol.resumed(record.id, record.conversation, record.config, rebuilt,
                                     units)

    def _rebuild(self, context: ContextRecord):
        """Hand the engine the saved context through its ordinary calls: the audio is encoded
        and everything prefilled in the batched stages, in order, ahead of any later reply."""
        sid, engine = self.session_id, self.engine
        if context.head is not None and context.spans:
            engine.instruct(sid, *context.head)
        for span in context.spans:
            if isinstance(span, MarkSpan):
                engine.mark(sid, span.key)
            elif isinstance(span, AudioSpan):
                engine.push_audio(sid, from_pcm16(span.pcm()))
            elif isinstance(span, TextSpan):
                engine.push_text(sid, span.text, span.role)
            elif isinstance(span, ReplySpan) and (ids := span.heard_ids(None, 1.0)):
                engine.push_reply(sid, ReplyTurn(tuple(ids), span.instructions, span.tools))
        return context.summary()


_MESSAGES: dict[type, Callable[[RealtimeSession, Any], list]] = {
    MediaAudio: lambda s, m: s.protocol.receive_audio(m.pcm),
    MediaFrame: lambda s, m: s.protocol.receive_video_frame(m.frame, m.pts_sample),
    Fenced: RealtimeSession._fenced,
    TranscriptReady: RealtimeSession._transcript,
    McpListed: lambda s, m: s.protocol.on_mcp_listed(m.item_id, m.tools, m.error),
    McpCalled: lambda s, m: s.protocol.on_mcp_called(m.item_id, m.output, m.error),
}
"""What only a Realtime session takes; the rest goes to SessionLoop."""
