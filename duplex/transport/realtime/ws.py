"""The WebSocket edge of the Realtime protocol: one asyncio loop per connection that feeds
frames, engine results, VAD probabilities and clock ticks to the pure protocol in order, and
carries out the effects it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from duplex.auth import choose_subprotocol
from duplex.engine import (
    AdmissionRefused,
    AudioOut,
    Engine,
    ResponseFinished,
    ResponseTimings,
    SessionFailed,
)
from duplex.limits import Quota
from duplex.logs import bind_session
from duplex.media.image import decode_image
from duplex.metrics import Metrics
from duplex.store import ResumeError, SessionRegistry
from duplex.store.keeper import SessionKeeper
from duplex.transport.realtime.protocol import (
    RATE,
    CloseConnection,
    EngineCancel,
    EngineClearInput,
    EngineCommit,
    EnginePush,
    EnginePushFrame,
    EnginePushImage,
    EnginePushText,
    FlushAudio,
    Limits,
    PlayAudio,
    RealtimeProtocol,
    ResumeSession,
    Send,
    VadFeed,
)
from duplex.vad import VadService, VadStream

log = logging.getLogger("duplex.realtime")
TICK_S = 0.02
# Events after which the conversation (or its settings) changed: saved at once, not at the
# next heartbeat.
_SAVE_AFTER = frozenset({
    "session.updated", "conversation.item.done", "conversation.item.truncated",
    "conversation.item.deleted", "response.done", "conversation.item.created",
})


class RealtimeSession:
    """One Realtime session on any carrier: frames go in through `inbox`, events out through
    `send_text`. The WebSocket endpoint, the WebRTC data channel and the benchmark's in-process
    clients all run this same loop.
    """

    def __init__(self, engine: Engine, vad: VadService, limits: Limits, model_name: str,
                 send_text, *, beta: bool = False, session_id: str | None = None,
                 media=None, video_interval_samples: int = RATE // 2,
                 registry: SessionRegistry | None = None, heartbeat_s: float = 2.0,
                 quota: Quota | None = None, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.vad = vad
        self.send_text = send_text
        self.media = media
        """A media track (WebRTC) with play(start_sample, pcm) and flush(); None for events."""
        self.session_id = session_id or "sess_" + secrets.token_hex(8)
        """This connection's name in the engine and hub; a resume changes only the protocol's
        (the registry's) id, so the same session resumed on this node never collides."""
        token = None
        if registry is not None:
            lease, token = registry.new_lease(self.session_id)
        self.protocol = RealtimeProtocol(
            self.session_id,
            model=model_name,
            model_input_rate=engine.model.input_rate,
            model_output_rate=engine.model.output_rate,
            beta=beta,
            limits=limits,
            media_track=media is not None,
            video_interval_samples=video_interval_samples,
            resume_token=token,
        )
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.vad_stream = VadStream()
        self.t0 = time.monotonic()
        self.close_code: int | None = None
        self.quota = quota
        self.metrics = metrics
        self._response_started: float | None = None
        self.keeper = None
        if registry is not None:
            self.keeper = SessionKeeper(
                registry, lease, lambda: self.protocol.snapshot(self.now_sample()),
                lambda: self.inbox.put_nowait(("fenced",)), heartbeat_s,
            )

    def now_sample(self) -> int:
        return int((time.monotonic() - self.t0) * RATE)

    def _post(self, item) -> None:
        # Engine and VAD threads may still answer after the session's loop has ended.
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.inbox.put_nowait, item)
            except RuntimeError:
                pass

    def open(self) -> None:
        """Admit the session into the engine; raises AdmissionRefused when over a limit."""
        self.engine.open(self.session_id, lambda event: self._post(("engine", event)))

    async def run(self) -> None:
        """Serve until the carrier is gone or the protocol closes; then release everything."""
        bind_session(self.protocol.session_id,
                     self.keeper.lease.epoch if self.keeper is not None else None)
        ticker = asyncio.create_task(self._tick())
        try:
            if self.keeper is not None:
                await self.keeper.start()
            await self._execute(self.protocol.start())
            await self._loop()
        finally:
            ticker.cancel()
            self.engine.close(self.session_id)
            if self.keeper is not None:
                await self.keeper.stop()
            held = self.protocol.close()
            if self.metrics is not None:
                for track, counters in self.protocol.core.tracks.items():
                    for reason, n in counters.dropped.items():
                        self.metrics.dropped.labels(track, reason).inc(n)
            log.info("session %s closed; released %s", self.session_id, held)

    def feed_text(self, text: str) -> None:
        self.inbox.put_nowait(("text", text))

    def feed_bytes(self, data: bytes) -> None:
        self.inbox.put_nowait(("bytes", data))

    def feed_audio(self, pcm) -> None:
        """Float32 mono at 24 kHz from a media track."""
        self.inbox.put_nowait(("audio", pcm))

    def feed_frame(self, frame, pts_sample: int) -> None:
        """A camera frame whose time on the input clock is `pts_sample` (24 kHz)."""
        self.inbox.put_nowait(("frame", frame, pts_sample))

    def carrier_gone(self) -> None:
        self.inbox.put_nowait(("gone",))

    async def shutdown(self, reason: str) -> None:
        self.inbox.put_nowait(("close", 1001, reason))

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self.inbox.put_nowait(("tick",))

    async def _loop(self) -> None:
        p = self.protocol
        while True:
            item = await self.inbox.get()
            kind = item[0]
            if kind == "gone":
                return
            if kind == "close":
                self.close_code = item[1]
                return
            if kind in ("text", "bytes") and self.quota is not None and (wait := self.quota.take()):
                effects = p.refuse("rate_limit_exceeded",
                                   f"Too many messages: this one was dropped. Retry in "
                                   f"{wait:.2f} s.")
            elif kind == "tick" and self._past_duration():
                effects = p.end("session_duration_exceeded",
                                f"Sessions last at most {self.quota.max_session_s:g} s "
                                "(limits.max_session_s).", 1008, "session duration limit")
            elif kind == "text":
                effects = p.receive_text(item[1])
            elif kind == "bytes":
                effects = p.receive_bytes(item[1])
            elif kind == "vad":
                effects = p.on_vad(item[1])
            elif kind == "engine" and isinstance(item[1], AudioOut):
                effects = p.on_engine_audio(item[1].epoch, item[1].pcm, item[1].text)
            elif kind == "engine" and isinstance(item[1], ResponseFinished):
                effects = p.on_engine_finished(item[1].epoch)
            elif kind == "engine" and isinstance(item[1], SessionFailed):
                effects = p.on_engine_failed(item[1].message)
            elif kind == "engine" and isinstance(item[1], ResponseTimings):
                t = item[1]
                effects = p.on_engine_timings({
                    "input": t.input_ms,
                    "thinker_first_token": t.thinker_first_token_ms,
                    "talker_first_codes": t.talker_first_codes_ms,
                    "codec_first_audio": t.codec_first_audio_ms,
                })
            elif kind == "fenced":
                effects = p.end("session_taken_over",
                                f"Session '{p.session_id}' was resumed on another connection; "
                                "this one no longer serves it.", 4409, "session taken over")
            elif kind == "audio":
                effects = p.receive_audio(item[1])
            elif kind == "frame":
                effects = p.receive_video_frame(item[1], item[2])
            else:
                effects = []
            effects += p.release_output(self.now_sample())
            if await self._execute(effects):
                return

    async def _push_image(self, data: bytes) -> None:
        try:
            rgb = await asyncio.to_thread(decode_image, data)
        except ValueError as exc:
            await self.send_text(json.dumps({
                "type": "error", "event_id": "event_" + secrets.token_hex(6),
                "error": {"type": "invalid_request_error", "code": "invalid_image",
                          "message": str(exc), "param": "item.content.0.image_url",
                          "event_id": None},
            }))
            return
        self.engine.push_frame(self.session_id, rgb)

    async def _execute(self, effects) -> bool:
        """Carry out effects in order; True when the session must end."""
        sid = self.session_id
        onset: int | None = None
        for effect in effects:
            if isinstance(effect, Send):
                await self.send_text(json.dumps(effect.event))
                if self.metrics is not None:
                    onset = self._observe(effect.event, onset)
                if self.keeper is not None and effect.event["type"] in _SAVE_AFTER:
                    self.keeper.touch()
            elif isinstance(effect, EnginePush):
                self.engine.push_audio(sid, effect.pcm)
            elif isinstance(effect, VadFeed):
                self.vad.submit(self.vad_stream, effect.pcm, lambda probs: self._post(("vad", probs)))
            elif isinstance(effect, EngineCommit):
                self.engine.commit(sid, effect.epoch)
            elif isinstance(effect, EngineCancel):
                self.engine.cancel(sid, effect.epoch)
            elif isinstance(effect, EngineClearInput):
                self.engine.clear_input(sid)
            elif isinstance(effect, EnginePushFrame):
                frame = effect.frame
                rgb = frame.to_ndarray(format="rgb24") if hasattr(frame, "to_ndarray") else frame
                self.engine.push_frame(sid, rgb)
            elif isinstance(effect, EnginePushText):
                self.engine.push_text(sid, effect.text)
            elif isinstance(effect, EnginePushImage):
                await self._push_image(effect.data)
            elif isinstance(effect, PlayAudio):
                self.media.play(effect.start_sample, effect.pcm)
            elif isinstance(effect, FlushAudio):
                self.media.flush()
            elif isinstance(effect, ResumeSession):
                if await self._execute(await self._resume(effect)):
                    return True
            elif isinstance(effect, CloseConnection):
                self.close_code = effect.code
                return True
        return False

    def _observe(self, event: dict, onset: int | None) -> int | None:
        """Feed TTFA and barge-in latency; returns the speech onset seen in this batch of
        effects (a barge-in's speech_started and cleared always come in one batch)."""
        type_ = event["type"]
        if type_ == "response.created":
            self._response_started = time.monotonic()
        elif self._response_started is not None and (
            type_.endswith("audio.delta") or type_ == "output_audio_buffer.started"
        ):
            self.metrics.ttfa.observe(time.monotonic() - self._response_started)
            self._response_started = None
        elif type_ == "input_audio_buffer.speech_started":
            return event["audio_start_ms"] * RATE // 1000 + self.protocol.detector.prefix_samples
        elif type_ == "output_audio_buffer.cleared" and onset is not None:
            self.metrics.barge_in.observe(max(0, self.now_sample() - onset) / RATE)
        return onset

    def _past_duration(self) -> bool:
        limit = self.quota.max_session_s if self.quota is not None else 0
        return bool(limit) and time.monotonic() - self.t0 >= limit

    async def _resume(self, effect: ResumeSession):
        if self.keeper is None:
            return self.protocol.refuse("session_not_found",
                                        "This server keeps no session registry.", "session_id")
        try:
            lease, record = await self.keeper.registry.resume(effect.session_id,
                                                              effect.resume_token)
        except ResumeError as exc:
            return self.protocol.refuse(exc.code, str(exc), "session_id")
        await self.keeper.switch(lease)
        bind_session(record.id, lease.epoch)
        self.protocol.resume_token = effect.resume_token
        log.info("session %s resumed at epoch %d (connection %s)", record.id, lease.epoch,
                 self.session_id)
        return self.protocol.resumed(record.id, record.conversation, record.config)


def admission_error(exc: AdmissionRefused) -> str:
    return json.dumps({
        "type": "error", "event_id": "event_admission",
        "error": {"type": "server_error", "code": "server_full", "message": str(exc),
                  "param": exc.limit, "event_id": None},
    })


def realtime_endpoint(engine_getter, vad_getter, limits: Limits, model_name: str, hub, *,
                      registry: SessionRegistry | None = None, heartbeat_s: float = 2.0,
                      metrics: Metrics | None = None):
    async def endpoint(ws: WebSocket) -> None:
        await ws.accept(subprotocol=choose_subprotocol(ws.scope.get("subprotocols", [])))
        beta = ws.headers.get("openai-beta", "").replace(" ", "").startswith("realtime=v1")
        # Set by the auth middleware: who connected, and the limits their messages draw on.
        state = ws.scope.get("state", {})
        principal = state.get("principal")
        session = RealtimeSession(engine_getter(), vad_getter(), limits, model_name, ws.send_text,
                                  beta=beta, registry=registry, heartbeat_s=heartbeat_s,
                                  quota=state.get("quota"), metrics=metrics,
                                  session_id=principal.session_id if principal else None)
        if principal is not None and principal.session:
            session.protocol.configure(principal.session)
        try:
            session.open()
        except AdmissionRefused as exc:
            await ws.send_text(admission_error(exc))
            await ws.close(1013, "server full")
            return
        hub.add(session.session_id, session.shutdown)

        async def read() -> None:
            try:
                while True:
                    message = await ws.receive()
                    if message["type"] == "websocket.disconnect":
                        break
                    if message.get("text") is not None:
                        session.feed_text(message["text"])
                    elif message.get("bytes") is not None:
                        session.feed_bytes(message["bytes"])
            except WebSocketDisconnect:
                pass
            session.carrier_gone()

        reader = asyncio.create_task(read())
        try:
            await session.run()
        finally:
            reader.cancel()
            if ws.application_state is WebSocketState.CONNECTED:
                try:
                    await ws.close(session.close_code or 1000)
                except RuntimeError:
                    pass
            hub.discard(session.session_id)

    return endpoint
