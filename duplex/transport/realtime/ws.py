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

from duplex.engine import (
    AdmissionRefused,
    AudioOut,
    Engine,
    ResponseFinished,
    ResponseTimings,
    SessionFailed,
)
from duplex.transport.realtime.protocol import (
    RATE,
    CloseConnection,
    EngineCancel,
    EngineClearInput,
    EngineCommit,
    EnginePush,
    EnginePushFrame,
    FlushAudio,
    Limits,
    PlayAudio,
    RealtimeProtocol,
    Send,
    VadFeed,
)
from duplex.vad import VadService, VadStream

log = logging.getLogger("duplex.realtime")
TICK_S = 0.02


class RealtimeSession:
    """One Realtime session on any carrier: frames go in through `inbox`, events out through
    `send_text`. The WebSocket endpoint, the WebRTC data channel and the benchmark's in-process
    clients all run this same loop.
    """

    def __init__(self, engine: Engine, vad: VadService, limits: Limits, model_name: str,
                 send_text, *, beta: bool = False, session_id: str | None = None,
                 media=None, video_interval_samples: int = RATE // 2) -> None:
        self.engine = engine
        self.vad = vad
        self.send_text = send_text
        self.media = media
        """A media track (WebRTC) with play(start_sample, pcm) and flush(); None for events."""
        self.session_id = session_id or "sess_" + secrets.token_hex(8)
        self.protocol = RealtimeProtocol(
            self.session_id,
            model=model_name,
            model_input_rate=engine.model.input_rate,
            model_output_rate=engine.model.output_rate,
            beta=beta,
            limits=limits,
            media_track=media is not None,
            video_interval_samples=video_interval_samples,
        )
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.vad_stream = VadStream()
        self.t0 = time.monotonic()
        self.close_code: int | None = None

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
        ticker = asyncio.create_task(self._tick())
        try:
            await self._execute(self.protocol.start())
            await self._loop()
        finally:
            ticker.cancel()
            self.engine.close(self.session_id)
            held = self.protocol.close()
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
            if kind == "text":
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
            elif kind == "audio":
                effects = p.receive_audio(item[1])
            elif kind == "frame":
                effects = p.receive_video_frame(item[1], item[2])
            else:
                effects = []
            effects += p.release_output(self.now_sample())
            if await self._execute(effects):
                return

    async def _execute(self, effects) -> bool:
        """Carry out effects in order; True when the session must end."""
        sid = self.session_id
        for effect in effects:
            if isinstance(effect, Send):
                await self.send_text(json.dumps(effect.event))
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
            elif isinstance(effect, PlayAudio):
                self.media.play(effect.start_sample, effect.pcm)
            elif isinstance(effect, FlushAudio):
                self.media.flush()
            elif isinstance(effect, CloseConnection):
                self.close_code = effect.code
                return True
        return False


def admission_error(exc: AdmissionRefused) -> str:
    return json.dumps({
        "type": "error", "event_id": "event_admission",
        "error": {"type": "server_error", "code": "server_full", "message": str(exc),
                  "param": exc.limit, "event_id": None},
    })


def realtime_endpoint(engine_getter, vad_getter, limits: Limits, model_name: str, hub):
    async def endpoint(ws: WebSocket) -> None:
        await ws.accept()
        beta = ws.headers.get("openai-beta", "").replace(" ", "").startswith("realtime=v1")
        session = RealtimeSession(engine_getter(), vad_getter(), limits, model_name, ws.send_text,
                                  beta=beta)
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
            hub.discard(session.session_id)
            if ws.application_state is WebSocketState.CONNECTED:
                try:
                    await ws.close(session.close_code or 1000)
                except RuntimeError:
                    pass

    return endpoint
