"""`POST /v1/realtime/calls` (SDP offer in, answer out) and `/hangup`, as OpenAI's WebRTC API.

Each call runs the same RealtimeSession as the WebSocket API: its events travel on the
`oai-events` data channel, the caller's microphone replaces input_audio_buffer.append, and reply
audio plays on a paced media track instead of audio delta events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.exceptions import InvalidStateError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from duplex.access.auth import Principal
from duplex.access.errors import error_response
from duplex.access.limits import OverLimit, Place
from duplex.engine import AdmissionRefused
from duplex.media.rates import REALTIME_RATE as RATE
from duplex.transport.realtime.session import RealtimeSession
from duplex.transport.sideband import Sidebands
from duplex.transport.webrtc.ice import offer_host_addresses
from duplex.transport.webrtc.media import ReplyTrack, read_audio, read_video
from duplex.transport.webrtc.offer import offer_problem

log = logging.getLogger("duplex.webrtc")
CHANNEL = "oai-events"
CONNECT_TIMEOUT_S = 15.0
"""A call whose peer has not connected by then is torn down. ICE alone may never give up: with
no candidates in the offer (a browser that posts it before gathering) it waits for the peer's
checks, which never come from a peer that has gone."""


async def _text(part: str | UploadFile) -> str:
    return part if isinstance(part, str) else (await part.read()).decode("utf-8", "replace")


class PeerConnection(RTCPeerConnection):
    """aiortc connects in a task of its own, started by each description. When close() stops the
    transports under it, it fails on the next one it starts (InvalidStateError, aiortc#429),
    and asyncio logs that error, which nobody retrieves, with its stack. Here a connect that
    lost its connection that way just ends."""

    async def _RTCPeerConnection__connect(self) -> None:  # aiortc's private __connect
        try:
            await super()._RTCPeerConnection__connect()
        except InvalidStateError:
            if self.signalingState != "closed":
                raise


class Call:
    """One WebRTC call; sidebands attach to it by its id (duplex.transport.sideband)."""

    def __init__(self, call_id: str, pc: PeerConnection, session: RealtimeSession,
                 track: ReplyTrack, owner: str) -> None:
        self.id = call_id
        self.pc = pc
        self.session = session
        self.track = track
        self.owner = owner
        self.sidebands = Sidebands()
        self.channel = None
        self.pending: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self.started = False
        """The session has sent its first event (session.created)."""

    def attached_event(self) -> str | None:
        # Before the session starts, a sideband gets its own session.created with everyone.
        return json.dumps(self.session.protocol.attached()) if self.started else None

    def feed_text(self, text: str) -> None:
        self.session.feed_text(text)

    def feed_bytes(self, data: bytes) -> None:
        self.session.feed_bytes(data)

    async def send_text(self, text: str) -> None:
        self.started = True
        self.sidebands.publish(text)
        # Events can come before the browser's data channel opens; they wait for it.
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(text)
        else:
            self.pending.append(text)

    def channel_opened(self) -> None:
        for text in self.pending:
            self.channel.send(text)
        self.pending.clear()


class CallRegistry:
    def __init__(self, engine_getter, vad_getter, limits, model_name: str, hub, webrtc_settings,
                 admission=None, transcriber_getter=lambda: None, duplex_default: bool = False):
        self.engine_getter = engine_getter
        self.duplex_default = duplex_default
        """Sessions start in native duplex (the model's duplex.default_mode)."""
        self.transcriber_getter = transcriber_getter
        self.vad_getter = vad_getter
        self.limits = limits
        self.model_name = model_name
        self.hub = hub
        self.settings = webrtc_settings
        self.calls: dict[str, Call] = {}
        self.admission = admission
        """Session and message limits; a call counts as a session until it ends."""
        offer_host_addresses(list(webrtc_settings.host_addresses))

    def _configuration(self) -> RTCConfiguration:
        servers = [
            RTCIceServer(urls=s.urls, username=s.username, credential=s.credential)
            for s in self.settings.ice_servers
        ]
        return RTCConfiguration(iceServers=servers)

    async def create(self, request: Request) -> Response:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        try:
            if content_type == "application/sdp":
                offer = (await request.body()).decode("utf-8", "replace"), None
            elif content_type == "multipart/form-data":
                offer = await self._read_form(request)
            else:
                return error_response(415, "unsupported_media_type",
                              "Send the SDP offer as application/sdp, or multipart/form-data with "
                              "parts 'sdp' and 'session'.")
        except ClientDisconnect:
            # Nobody is left to read an answer; this one only ends the request.
            return error_response(400, "client_disconnected", "The request body was cut off.")
        if isinstance(offer, Response):
            return offer
        sdp, session_config = offer
        if problem := offer_problem(sdp):
            return error_response(400, "invalid_offer", f"The SDP offer was refused: {problem}.", "sdp")

        principal = request.scope.get("state", {}).get("principal") or Principal("anonymous")
        key_id = principal.key_id
        quota = seat = None
        if self.admission is not None:
            try:
                seat = await self.admission.enter(key_id)
            except OverLimit as over:
                return error_response(429, "rate_limit_exceeded", str(over),
                                      headers={"Retry-After": "1"})
            quota = self.admission.quota(key_id)
        try:
            duplex_events = request.query_params.get("duplex_events", "").lower() in ("1", "true")
            response = await self._create(sdp, session_config, quota, seat, duplex_events,
                                          principal)
        except BaseException:
            self._leave(seat)
            raise
        if response.status_code != 201:
            self._leave(seat)
        return response

    async def open_call(self, sdp: str, session_config: dict | None = None, *,
                        duplex_events: bool = False) -> Response:
        """A call from an SDP offer, as the endpoint opens one but outside any key's limits:
        for peers in this process (the bench's listeners)."""
        return await self._create(sdp, session_config, None, None, duplex_events,
                                  Principal("anonymous"))

    @staticmethod
    async def _read_form(request: Request) -> tuple[str, dict | None] | Response:
        """The offer and session config of a multipart request, or the error that answers it."""
        try:
            async with request.form() as form:
                sdp_part, session_part = form.get("sdp"), form.get("session")
                if sdp_part is None:
                    return error_response(400, "missing_required_parameter",
                                  "Missing the multipart part 'sdp'.", "sdp")
                sdp = await _text(sdp_part)
                raw = await _text(session_part) if session_part is not None else None
        except HTTPException as exc:  # Starlette's answer to a body that is not multipart
            return error_response(400, "invalid_multipart", f"The multipart body is malformed: {exc.detail}")
        if raw is None:
            return sdp, None
        try:
            session_config = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
            return error_response(400, "invalid_json", "The 'session' part is not valid JSON.", "session")
        if not isinstance(session_config, dict):
            return error_response(400, "invalid_value", "The 'session' part must be a JSON object.",
                          "session")
        return sdp, session_config

    def _leave(self, seat: Place | None) -> None:
        if seat is not None:
            self.admission.leave(seat)

    async def _create(self, sdp: str, session_config, quota, seat: Place | None,
                      duplex_events: bool, principal: Principal) -> Response:
        call_id = "rtc_" + secrets.token_hex(8)
        pc = PeerConnection(self._configuration())
        track = ReplyTrack()
        holder: dict[str, Call] = {}

        async def send_text(text: str) -> None:
            await holder["call"].send_text(text)

        session = RealtimeSession(
            self.engine_getter(), self.vad_getter(), self.limits, self.model_name, send_text,
            media=track, video_interval_samples=int(RATE / self.settings.video_fps), quota=quota,
            transcriber=self.transcriber_getter(), duplex_events=duplex_events,
            duplex_default=self.duplex_default, session_id=principal.session_id,
        )
        if principal.session:
            # An ephemeral key's settings (validated when it was minted): session.created
            # shows them.
            session.protocol.configure(principal.session)
        call = Call(call_id, pc, session, track, principal.key_id)
        holder["call"] = call
        try:
            session.open()
        except AdmissionRefused as exc:
            await pc.close()
            return error_response(429, "server_full", str(exc), headers={"Retry-After": "5"})
        track.on_played = session.protocol.on_playback

        @pc.on("datachannel")
        def on_datachannel(channel) -> None:
            if channel.label != CHANNEL:
                return
            call.channel = channel
            channel.on("open", call.channel_opened)
            # Events have no other way to the peer; without them the call is over.
            channel.on("close", session.carrier_gone)
            if channel.readyState == "open":
                call.channel_opened()

            @channel.on("message")
            def on_message(message) -> None:
                if isinstance(message, str):
                    session.feed_text(message)
                else:
                    session.feed_bytes(message)

        @pc.on("track")
        def on_track(remote) -> None:
            if remote.kind == "audio":
                call.tasks.append(asyncio.create_task(read_audio(remote, session.feed_audio)))
            elif remote.kind == "video":
                call.tasks.append(asyncio.create_task(read_video(remote, session.feed_frame)))

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                session.carrier_gone()

        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            pc.addTrack(track)
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:  # aiortc raises ValueError and others for offers it cannot take
            self.engine_getter().close(session.session_id)
            await self._tear_down(call)
            return error_response(400, "invalid_offer", f"The SDP offer was refused: {exc}", "sdp")

        self.calls[call_id] = call
        self.hub.add(session.session_id, session.shutdown)
        self.hub.calls[call_id] = call
        if session_config is not None:
            session.feed_text(json.dumps({"type": "session.update", "session": session_config}))
        call.tasks.append(asyncio.create_task(self._serve(call, seat)))
        call.tasks.append(asyncio.create_task(self._connect_deadline(call)))
        return Response(
            pc.localDescription.sdp,
            status_code=201,
            media_type="application/sdp",
            headers={"Location": f"/v1/realtime/calls/{call_id}"},
        )

    async def _serve(self, call: Call, seat: Place | None) -> None:
        try:
            await call.session.run()
        finally:
            self.calls.pop(call.id, None)
            self.hub.calls.pop(call.id, None)
            call.sidebands.close()
            try:
                await self._tear_down(call)
            finally:
                self._leave(seat)
                self.hub.discard(call.session.session_id)

    @staticmethod
    async def _connect_deadline(call: Call) -> None:
        await asyncio.sleep(CONNECT_TIMEOUT_S)
        if call.pc.connectionState != "connected":
            log.info("call %s: the peer did not connect within %g s", call.id, CONNECT_TIMEOUT_S)
            call.session.carrier_gone()

    @staticmethod
    async def _tear_down(call: Call) -> None:
        """Stop the call's media and close its peer connection, which tells the peer."""
        for task in call.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        call.track.stop()
        await call.pc.close()

    async def hangup(self, request: Request) -> Response:
        call = self.calls.get(request.path_params["call_id"])
        principal = request.scope.get("state", {}).get("principal") or Principal("anonymous")
        # Another key's call does not exist for it, as for a sideband.
        if call is None or call.owner != principal.key_id:
            return error_response(404, "call_not_found", "No such call.")
        call.session.carrier_gone()
        return JSONResponse({})
