"""Listeners of each transport that play what they receive in real time, in the bench's process:
a phone behind Twilio, a WebSocket client of the Realtime API, an aiortc WebRTC peer.

Each has a clock (samples at its own rate since it started), a microphone that sends the audio
placed on it (`say`) frame by frame once each frame could have been captured, and a playout
(duplex.bench.playout) of the reply audio it receives, tagged with the reply it belongs to:

- Twilio: media plays back to back; each mark comes back when playback reaches it; a `clear`
  empties the buffer at once and its marks come back at once.
- WebSocket: audio deltas play back to back; `input_audio_buffer.speech_started` flushes what
  has not played, as LiveKit, Pipecat and the OpenAI Agents SDK do. One that knows this
  server's extension also pauses its playout at `duplex.output.paused` and resumes it at
  `duplex.output.resumed`.
- WebRTC: what aiortc's receiver hands out plays as it comes (its jitter buffer is the
  playout). The server's reply track is tapped for when it sent each frame and what it
  carried, so the peer knows each frame's reply and its own receive path (send to play).

Every server event is kept for the caller's script (`events`), and the pauses the peer can see
(Twilio's clear; `duplex.output.paused` on the Realtime carriers).
"""

from __future__ import annotations

import asyncio
import base64
import fractions
import json
import time
from collections.abc import Callable

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from duplex.bench.playout import Playout
from duplex.media import float_to_g711, float_to_pcm16, g711_to_float
from duplex.transport.realtime.protocol import Limits
from duplex.transport.realtime.session import RealtimeSession
from duplex.transport.twilio.protocol import Options
from duplex.transport.twilio.ws import TwilioSession
from duplex.transport.webrtc.calls import CallRegistry
from duplex.transport.webrtc.ice import offer_host_addresses

SID = "MZ00000000000000000000000000000bench"


class Peer:
    rate: int
    frame: int

    def __init__(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.playout = Playout()
        self.user = np.zeros(int(seconds * self.rate), np.float32)
        """What the caller says, by clock sample."""
        self.events: list[tuple[int, dict]] = []
        self.pauses: list[int] = []
        """Clock samples at which the peer saw a reply pause."""
        self.reply_samples: dict[object, int] = {}
        """Samples of each reply the server produced (its length had nobody talked over it),
        where the peer can know it."""
        self.mic_late_ms: list[float] = []
        """How late each microphone frame went, past the moment it was captured."""
        self.session = None
        self._run: asyncio.Task | None = None
        """The session's loop, for the peers that run their session here."""
        self._tasks: list[asyncio.Task] = []

    def now(self) -> int:
        return int((time.monotonic() - self.t0) * self.rate)

    def at(self, sample: int) -> float:
        """The monotonic time of clock sample `sample`."""
        return self.t0 + sample / self.rate

    def say(self, pcm: np.ndarray, at: int) -> None:
        """The caller says `pcm` from clock sample `at` on."""
        self.user[at : at + len(pcm)] += pcm[: max(0, len(self.user) - at)]

    def next_frame(self) -> int:
        """The first clock sample of the next microphone frame not yet captured."""
        return -(-self.now() // self.frame) * self.frame

    def _serve(self) -> None:
        self.session.open()
        self._run = asyncio.create_task(self.session.run())

    def reply_length(self, reply: object) -> int | None:
        """Samples (at the peer's rate) of reply `reply` as the server produced it."""
        return self.reply_samples.get(reply)

    def heard_samples(self, reply: object) -> int:
        """Samples (at the peer's rate) of reply `reply` the listener played."""
        return len(self.playout.heard(reply))

    def _keep_reply_lengths(self) -> None:
        """Before the session closes (its core forgets its replies then): each reply's length,
        by its id on the core, which is how this peer tags them."""
        protocol = self.session.protocol
        scale = self.rate / protocol.clock.rate
        self.reply_samples |= {r.id: round(r.sent_samples * scale) for r in protocol.core.responses}

    async def close(self) -> None:
        """Hang up: the session ends as when its carrier goes, and releases everything."""
        if self.session is not None:
            self._keep_reply_lengths()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._run is not None:
            self.session.carrier_gone()
            await self._run

    async def _microphone(self, send: Callable[[np.ndarray], None]) -> None:
        """Each frame once its last sample could have been captured."""
        i = self.now() // self.frame
        while (i + 1) * self.frame <= len(self.user):
            due = self.at((i + 1) * self.frame)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            self.mic_late_ms.append(max(0.0, time.monotonic() - due) * 1000)
            send(self.user[i * self.frame : (i + 1) * self.frame])
            i += 1


class TwilioPeer(Peer):
    rate, frame = 8000, 160

    def __init__(self, name: str, engine, vad, options: Options, metrics, seconds: float) -> None:
        super().__init__(seconds)
        self.session = TwilioSession(engine, vad, options, metrics, self._receive,
                                     session_id=name)
        self._seq = 0
        self._chunk = 0
        self._media: list[np.ndarray] = []
        """Frames received since the last mark: the mark names their reply."""

    async def start(self) -> None:
        s = self.session
        self._serve()
        s.feed_text(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        self._send({"event": "start", "start": {
            "streamSid": SID, "accountSid": "AC0", "callSid": "CA0", "tracks": ["inbound"],
            "customParameters": {},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
        self._tasks.append(asyncio.create_task(self._microphone(self._media_out)))

    def _send(self, message: dict) -> None:
        self._seq += 1
        self.session.feed_text(json.dumps({"sequenceNumber": str(self._seq), "streamSid": SID,
                                           **message}))

    def _media_out(self, pcm: np.ndarray) -> None:
        self._chunk += 1
        self._send({"event": "media", "media": {
            "track": "inbound", "chunk": str(self._chunk), "timestamp": str(self._chunk * 20),
            "payload": base64.b64encode(float_to_g711(pcm, "ulaw")).decode()}})

    async def _receive(self, text: str) -> None:
        now = self.now()
        message = json.loads(text)
        kind = message["event"]
        self.events.append((now, message))
        if kind == "media":
            self._media.append(g711_to_float(base64.b64decode(message["media"]["payload"]), "ulaw"))
        elif kind == "mark":
            name = message["mark"]["name"]
            reply = int(name.split(".")[1][1:])
            self.playout.push(now, np.concatenate(self._media), reply)
            self._media.clear()
            due = self.playout.mark(now, name)
            asyncio.get_running_loop().call_at(self.at(due), self._echo_played)
        elif kind == "clear":
            self.pauses.append(now)
            self._media.clear()
            for name in self.playout.reached(now) + self.playout.clear(now):
                self._echo(name)

    def _echo_played(self) -> None:
        for name in self.playout.reached(self.now()):
            self._echo(name)

    def _echo(self, name: str) -> None:
        self._send({"event": "mark", "mark": {"name": name}})


class RealtimePeer(Peer):
    """A WebSocket client of the Realtime API, in process (the same session loop). With
    `follows_pauses` it also stops its playout at `duplex.output.paused`, keeping what it had
    not played, and plays that on at `duplex.output.resumed` (this server's extension)."""

    rate, frame = 24000, 480

    def __init__(self, name: str, engine, vad, limits: Limits, seconds: float, *,
                 follows_pauses: bool = False) -> None:
        super().__init__(seconds)
        self.session = RealtimeSession(engine, vad, limits, engine.model.name, self._receive,
                                       session_id=name, duplex_events=True)
        self.follows_pauses = follows_pauses
        self._held: list[tuple[np.ndarray, object]] | None = None
        """What it stopped playing at a pause, while paused."""

    async def start(self) -> None:
        self._serve()
        self._tasks.append(asyncio.create_task(self._microphone(self._append)))

    def _append(self, pcm: np.ndarray) -> None:
        self.session.feed_text(json.dumps({"type": "input_audio_buffer.append",
                                           "audio": base64.b64encode(float_to_pcm16(pcm)).decode()}))

    def _keep_reply_lengths(self) -> None:
        """Its replies are tagged by response id, and their lengths counted as they came."""

    async def _receive(self, text: str) -> None:
        now = self.now()
        event = json.loads(text)
        kind = event["type"]
        self.events.append((now, event))
        if kind == "response.output_audio.delta":
            pcm = np.frombuffer(base64.b64decode(event["delta"]), "<i2").astype(np.float32) / 32768
            rid = event["response_id"]
            if self._held is not None:
                self._held.append((pcm, rid))
            else:
                self.playout.push(now, pcm, rid)
            self.reply_samples[rid] = self.reply_samples.get(rid, 0) + len(pcm)
        elif kind == "input_audio_buffer.speech_started":
            # What has not played never will: the client drops its buffer.
            self.playout.clear(now)
            self._held = None
        elif kind == "duplex.output.paused":
            self.pauses.append(now)
            if self.follows_pauses:
                self._held = self.playout.take(now)
        elif kind == "duplex.output.resumed" and self._held is not None:
            for pcm, rid in self._held:
                self.playout.push(now, pcm, rid)
            self._held = None


class _Microphone(MediaStreamTrack):
    """The WebRTC peer's microphone: frame i carries the caller's clock samples
    [i * 960, (i + 1) * 960), sent once captured."""

    kind = "audio"

    def __init__(self, peer: WebRTCPeer) -> None:
        super().__init__()
        self.peer = peer
        self.first: int | None = None
        self.i = 0

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        p, n = self.peer, self.peer.frame
        if self.first is None:
            self.first = self.i = p.now() // n
        due = p.at((self.i + 1) * n)
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        p.mic_late_ms.append(max(0.0, time.monotonic() - due) * 1000)
        pcm = p.user[self.i * n : (self.i + 1) * n]
        pcm = np.pad(pcm, (0, n - len(pcm)))
        samples = np.frombuffer(float_to_pcm16(pcm), np.int16).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate, frame.time_base = p.rate, fractions.Fraction(1, p.rate)
        frame.pts = (self.i - self.first) * n
        self.i += 1
        return frame


class WebRTCPeer(Peer):
    rate, frame = 48000, 960

    def __init__(self, registry: CallRegistry, seconds: float) -> None:
        super().__init__(seconds)
        self.registry = registry
        offer_host_addresses(["127.0.0.1"])
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.pc.addTrack(_Microphone(self))
        self.channel = self.pc.createDataChannel("oai-events")
        self.channel.on("message", self._event)
        self.pc.on("track", self._on_track)
        self.call = None
        self.sent: list[tuple[float, int]] = []
        """The server's reply track, frame by frame: (when it sent it, output position played
        after it)."""
        self.frames: dict[int, tuple[int, int]] = {}
        """Playout start (clock sample) of each reply frame -> (its index on the server's
        track, the clock sample at which the track sent it)."""
        self.paths_ms: list[float] = []
        """The server's track to this peer's loudspeaker, for every frame of reply audio: its
        own receive path, all of it (what aiortc holds and decodes, and what its playout
        holds: a frame that comes while the one before still plays waits for it, as in a
        browser's buffer, and a loaded host's bursts of frames leave it holding more)."""
        self.receive_ms: list[float] = []
        """The part of it up to aiortc's hands (its jitter buffer and the codec)."""

    async def start(self) -> None:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        answer = await self.registry.open_call(self.pc.localDescription.sdp, duplex_events=True)
        if answer.status_code != 201:
            raise RuntimeError(f"the call was refused: {answer.status_code} {answer.body!r}")
        self.call = self.registry.calls[answer.headers["location"].rsplit("/", 1)[1]]
        played = self.call.track.on_played

        def tap(position: int) -> None:
            self.sent.append((time.monotonic(), position))
            played(position)

        self.call.track.on_played = tap
        await self.pc.setRemoteDescription(RTCSessionDescription(answer.body.decode(), "answer"))

    def _event(self, message: str) -> None:
        now = self.now()
        event = json.loads(message)
        self.events.append((now, event))
        if event["type"] == "duplex.output.paused":
            self.pauses.append(now)

    def _on_track(self, track) -> None:
        self._tasks.append(asyncio.create_task(self._play(track)))

    async def _play(self, track) -> None:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=self.rate)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            received, now = time.monotonic(), self.now()
            pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in resampler.resample(frame)])
            k = frame.pts // self.frame
            reply = self._reply_in(k)
            sent = int((self.sent[k][0] - self.t0) * self.rate) if k < len(self.sent) else now
            start = self.playout.push(now, pcm, reply, sent)
            if reply is not None:
                self.frames[start] = (k, sent)
                self.paths_ms.append((start - sent) * 1000 / self.rate)
                self.receive_ms.append((received - self.sent[k][0]) * 1000)

    def _reply_in(self, k: int) -> int | None:
        """The reply whose audio server frame `k` carried (its id on the session core)."""
        if k >= len(self.sent) or (k and self.sent[k][1] == self.sent[k - 1][1]) or k == 0:
            return None
        position = self.sent[k][1] - 1
        # Newest first: a reply cut short gives the positions past its cut to the next one.
        for r in reversed(self.call.session.protocol.core.responses):
            if r.start_sample <= position < r.start_sample + max(r.sent_samples, r.delivered_samples):
                return r.id
        return None

    def heard_samples(self, reply: object) -> int:
        """What the frames of `reply` it played carried of it, by the server's track: a frame
        is played whole, though the reply may fill only part of it (where it starts, holds,
        resumes, ends)."""
        carried = sum(self.sent[k][1] - self.sent[k - 1][1]
                      for start, (k, _) in self.frames.items()
                      if self.playout.tag_at(start) == reply)
        return carried * self.rate // 24000

    def path_ms(self, stop: int) -> float | None:
        """The receive path (the server's track to the loudspeaker) of the reply frame that
        ended at clock sample `stop`."""
        for start, (_, sent) in self.frames.items():
            if start < stop <= start + self.frame:
                return (start - sent) * 1000 / self.rate
        return None

    async def close(self) -> None:
        self.session = self.call.session if self.call is not None else None
        await super().close()
        await self.pc.close()
        if self.call is not None:
            self.call.session.carrier_gone()
            await asyncio.gather(*self.call.tasks, return_exceptions=True)
