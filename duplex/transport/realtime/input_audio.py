"""The input side of a Realtime session: audio appended as base64 (PCM16, or G.711 resampled
from 8 kHz) or carried by a media track, counted onto the session clock and passed on to the
model and the speech detector; the uncommitted buffer, its commit into a user item and its
clear; and the transcription of each committed item, when the session asked for it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duplex.media import Resampler, g711_to_float, pcm16_to_float
from duplex.media.fir import FirResampler, ResamplerState
from duplex.media.pcm import PcmError
from duplex.media.rates import ASR_RATE
from duplex.media.rates import REALTIME_RATE as RATE
from duplex.session import commands as cmd
from duplex.transcription.recognizer import Hints
from duplex.transport.core import MediaClock
from duplex.transport.effects import EngineClearInput, EnginePush
from duplex.transport.realtime.conversation import Conversation, Item
from duplex.transport.realtime.errors import ProtocolError
from duplex.transport.realtime.events import EventWriter
from duplex.transport.realtime.live_transcript import LiveTranscript
from duplex.transport.realtime.model_context import ModelContext
from duplex.transport.realtime.replies import G711_LAWS
from duplex.transport.realtime.session_config import SessionSettings

INPUT_TRACK = "input_audio"
OPENAI_TRANSCRIBE = "whisper-1"
"""What a transcription config without a model asks for: the server's configured recogniser."""


@dataclass(frozen=True)
class Transcribe:
    """Recognise `pcm` (float32 at 16 kHz), the audio of user item `item_id`, with `model`,
    told `hints`; answer with `on_transcript`. A partial one hears audio not yet committed."""

    item_id: str
    model: str
    pcm: np.ndarray
    hints: Hints = Hints()
    partial: bool = False


class InputAudio:
    def __init__(self, clock: MediaClock, events: EventWriter, conversation: Conversation,
                 settings: Callable[[], SessionSettings], context: ModelContext, *,
                 max_lead_ms: int, transcription_models: tuple[str, ...],
                 transcription_languages: Callable[[str], tuple[str, ...] | None]) -> None:
        self.clock = clock
        self.context = context
        self.core = clock.core
        self.events = events
        self.conversation = conversation
        self.settings = settings
        self.max_lead_ms = max_lead_ms
        """How far appended audio may run ahead of real time before appends are refused."""
        self.transcription_models = transcription_models
        """The server's own recogniser names; empty: it has none."""
        self.transcription_languages = transcription_languages
        self.live = LiveTranscript()
        self.samples = 0
        self.uncommitted_samples = 0
        self.speech_item_id: str | None = None
        """The id the uncommitted audio's item takes, named when its speech started."""
        # Resumable, like the model's input resampler after it: a resumed G.711 session's
        # model input goes on sample for sample.
        self._g711_in = FirResampler(8000, RATE)
        self._to_asr = Resampler(RATE, ASR_RATE)
        self._asr_audio: list[np.ndarray] = []
        """Uncommitted input at the recogniser's rate, kept only while transcription is on."""

    def append_base64(self, out: list, audio: str, param: str) -> None:
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("invalid_value", f"Invalid value for '{param}': not valid base64.",
                                param) from None
        try:
            pcm = self._decode(data)
        except PcmError as exc:
            raise ProtocolError("invalid_value", f"Invalid value for '{param}': {exc}.",
                                param) from None
        self.receive(out, pcm)

    def _decode(self, data: bytes) -> np.ndarray:
        fmt = self.settings().input_format
        if fmt == "audio/pcm":
            return pcm16_to_float(data)
        return self._g711_in.process(g711_to_float(data, G711_LAWS[fmt]))

    def decode_item_audio(self, audio: str, param: str) -> np.ndarray:
        """An item's audio part (base64 in the session's input format) as float32 at 24 kHz,
        apart from the input stream (whose resampler state it must not touch)."""
        try:
            data = base64.b64decode(audio, validate=True)
            fmt = self.settings().input_format
            if fmt == "audio/pcm":
                return pcm16_to_float(data)
            return Resampler(8000, RATE).process(g711_to_float(data, G711_LAWS[fmt]), last=True)
        except (binascii.Error, ValueError, PcmError) as exc:
            raise ProtocolError("invalid_value", f"Invalid value for '{param}': {exc}.",
                                param) from None

    def g711_state(self) -> ResamplerState | None:
        """Where the G.711 upsampler stands; None while no G.711 audio has come in."""
        return self._g711_in.state() if self._g711_in.fed else None

    def resume_g711(self, state: ResamplerState) -> None:
        self._g711_in = FirResampler.resume(8000, RATE, state)

    def receive(self, out: list, pcm: np.ndarray) -> None:
        """Float32 on the session clock, from an append or a media track."""
        n = len(pcm)
        self.core.handle(cmd.AudioReceived(INPUT_TRACK, n))
        if self.samples - self.core.now_sample + n > self.max_lead_ms * RATE // 1000:
            self.core.handle(cmd.InputDropped(INPUT_TRACK, n, "faster_than_real_time"))
            raise ProtocolError("input_rate_exceeded",
                                f"Audio is being appended faster than real time (more than "
                                f"{self.max_lead_ms} ms ahead); this chunk was dropped.", "audio")
        self.samples += n
        self.uncommitted_samples += n
        self.core.handle(cmd.InputConsumed(INPUT_TRACK, n))
        if n == 0:
            return
        settings = self.settings()
        self.to_model(out, self.clock.input_effects(
            pcm, detect_speech=settings.turn_detection is not None))
        if settings.transcription is not None:
            self._asr_audio.append(self._to_asr.process(pcm))
            self._hear_again(out, settings)

    def to_model(self, out: list, effects: list) -> None:
        """Input effects, audio for the model among them: that audio opens the uncommitted
        tail's unit of context first (none reaches the model of a transcription session,
        which never answers)."""
        if self.settings().type == "transcription":
            effects = [e for e in effects if not isinstance(e, EnginePush)]
        elif any(isinstance(e, EnginePush) for e in effects):
            self.context.open_tail(out)
        out += effects

    def commit(self, out: list) -> None:
        """input_audio_buffer.commit: at least 100 ms of audio becomes a user item."""
        if self.uncommitted_samples < RATE // 10:
            raise ProtocolError("input_audio_buffer_commit_empty",
                                f"Error committing input audio buffer: buffer too small. Expected at "
                                f"least 100ms of audio, but buffer only has "
                                f"{self.uncommitted_samples * 1000 // RATE}ms of audio.")
        self.commit_as(out, self.speech_item_id or self.events.new_id("item"), asked=True)

    def commit_as(self, out: list, item_id: str, asked: bool = False) -> Item:
        """`asked`: the client committed; what input is held back goes to the model too."""
        self.to_model(out, self.clock.commit_input(asked))
        item = Item(item_id, role="user", content_type="input_audio",
                    unit=self.context.commit_tail())
        previous = self.conversation.append(item)
        self.uncommitted_samples = 0
        self.speech_item_id = None
        emit = self.events.emit
        emit(out, "input_audio_buffer.committed", item_id=item.id, previous_item_id=previous)
        emit(out, "conversation.item.added", item=item.as_wire(), previous_item_id=previous)
        emit(out, "conversation.item.done", item=item.as_wire(), previous_item_id=previous)
        self.transcribe(out, item)
        return item

    def clear(self, out: list) -> None:
        self.uncommitted_samples = 0
        self._asr_audio = []
        self.clock.gate.clear()
        self.live.cleared()
        if self.context.enabled:
            self.context.drop_tail()
        else:
            out.append(EngineClearInput())
        self.events.emit(out, "input_audio_buffer.cleared")

    # -- transcription ----------------------------------------------------------------------

    def check_transcription(self, new: SessionSettings, beta: bool) -> None:
        """Any model name selects a recogniser (see `Transcriber.recognizer`); a language it
        does not transcribe is the client's error, naming those it does."""
        config = new.transcription
        if config is None or config == self.settings().transcription:
            return
        prefix = "session.input_audio_transcription" if beta else "session.audio.input.transcription"
        if not self.transcription_models:
            raise ProtocolError("invalid_value", "This server has no speech recogniser; "
                                "input audio transcription is not available.", f"{prefix}.model")
        language = config.get("language")
        known = self.transcription_languages(config.get("model") or OPENAI_TRANSCRIBE)
        if language and known is not None and language.lower() not in known:
            param = f"{prefix}.language"
            raise ProtocolError("invalid_value",
                                f"Invalid value for '{param}': this server's recogniser does not "
                                f"transcribe '{language}'; it transcribes: {', '.join(known)}.",
                                param)

    def _hints(self, config: dict, item_id: str, prefix: str = "") -> Hints:
        language = config.get("language")
        return Hints(language.lower() if language else None, config.get("prompt"), prefix)

    def _model(self, config: dict) -> str:
        return config.get("model") or OPENAI_TRANSCRIBE

    def _hear_again(self, out: list, settings: SessionSettings) -> None:
        """While the user speaks, the uncommitted audio goes to the recogniser again now and
        then, for the partial transcript (live_transcript.py)."""
        if settings.turn_detection is not None and not self.clock.detector.speaking:
            return
        if self.speech_item_id is None:
            # Manual commits: the audio's item takes this id when committed.
            self.speech_item_id = self.events.new_id("item")
        item_id = self.speech_item_id
        heard = sum(len(a) for a in self._asr_audio)
        if self.live.due(item_id, heard):
            config = settings.transcription
            out.append(Transcribe(item_id, self._model(config), np.concatenate(self._asr_audio),
                                  self._hints(config, item_id, self.live.prefix(item_id)),
                                  partial=True))

    def transcribe(self, out: list, item: Item) -> None:
        """The item's audio goes to the recogniser (its transcript comes back later)."""
        audio, self._asr_audio = self._asr_audio, []
        config = self.settings().transcription
        if config is None:
            self.live.cleared()
            return
        tail = self._to_asr.process(np.zeros(0, np.float32), last=True)
        self._to_asr = Resampler(RATE, ASR_RATE)
        pcm = np.concatenate([*audio, tail]) if audio else tail
        request = self.live.committed(item.id, lambda sent: Transcribe(
            item.id, self._model(config), pcm, self._hints(config, item.id, sent)))
        if request is not None:
            out.append(request)

    def transcribe_item(self, out: list, item: Item, pcm: np.ndarray) -> None:
        """A created item's audio (float32 at 24 kHz) goes to the recogniser."""
        config = self.settings().transcription
        if config is not None:
            out.append(Transcribe(item.id, self._model(config),
                                  Resampler(RATE, ASR_RATE).process(pcm, last=True),
                                  self._hints(config, item.id)))

    def on_transcript(self, out: list, item_id: str, text: str | None, error: str | None,
                      audio_s: float, partial: bool = False) -> None:
        emit = self.events.emit
        if partial:
            delta, final = self.live.on_partial(item_id, text if error is None else "")
            if delta:
                emit(out, "conversation.item.input_audio_transcription.delta", item_id=item_id,
                     content_index=0, delta=delta)
            if final is not None:
                out.append(final)
            return
        if error is not None:
            emit(out, "conversation.item.input_audio_transcription.failed", item_id=item_id,
                 content_index=0, error={"type": "server_error", "code": "transcription_failed",
                                         "message": error, "param": None})
            return
        item = self.conversation.find(item_id)
        if item is not None:
            item.transcript = text
        if delta := self.live.on_final(item_id, text):
            emit(out, "conversation.item.input_audio_transcription.delta", item_id=item_id,
                 content_index=0, delta=delta)
        emit(out, "conversation.item.input_audio_transcription.completed", item_id=item_id,
             content_index=0, transcript=text,
             usage={"type": "duration", "seconds": round(audio_s, 3)})
