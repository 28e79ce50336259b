"""What every protocol core does around the session core, in one place, and the interface the
session loop drives them through.

A protocol core (Realtime, Twilio) turns its wire's messages into session commands and
effects. Around that, each needs the same media plumbing on its session clock: audio on its way
to the model and to the speech detector, reply audio from the model's rate onto the clock (and
the resampler's tail at the end of a reply), paced release of that audio, speech decisions from
speech probabilities, and the engine's side of a barge-in. `MediaClock` holds it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from duplex.media import Resampler
from duplex.media.echo import EchoGuard
from duplex.media.fir import FirResampler, ResamplerState
from duplex.media.rates import VAD_CHUNK, VAD_RATE
from duplex.media.tempo import Piece, ReplyTempo
from duplex.session import commands as cmd
from duplex.session import events as ev
from duplex.session.pacing import OutputPacer
from duplex.session.state import Session
from duplex.session.turn_detection import ScoreTurn, TurnDetector
from duplex.transport.effects import EngineCancel, EnginePush, ScoreTurnEnd, VadFeed
from duplex.transport.turn_audio import HeardAudio, InputGate

SpeechCommand = cmd.SpeechStarted | cmd.SpeechStopped | cmd.VoiceActivity | ScoreTurn


class ProtocolCore(Protocol):
    """What `SessionLoop` drives: every entry point returns the effects to carry out."""

    clock: MediaClock

    def receive_text(self, text: str) -> list[Any]: ...

    def receive_bytes(self, data: bytes) -> list[Any]: ...

    def on_vad(self, probs: list[float], early: float | None = None) -> list[Any]: ...

    def on_turn_score(self, request: int, complete: float | None) -> list[Any]: ...

    def on_engine_audio(self, epoch: int, pcm: np.ndarray, text: str) -> list[Any]: ...

    def on_engine_finished(self, epoch: int, reason: str) -> list[Any]: ...

    def on_engine_failed(self, message: str) -> list[Any]: ...

    def release_output(self, now: int) -> list[Any]: ...


def json_object(text: str) -> dict[str, Any] | str:
    """The JSON object a text frame holds, or why it holds none."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        return f"not valid JSON: {exc}"
    except RecursionError:
        return "not valid JSON: nested too deep to parse"
    if not isinstance(raw, dict):
        return "not a JSON object"
    return raw


class MediaClock:
    def __init__(self, session_id: str, *, rate: int, model_input_rate: int,
                 model_output_rate: int, lead_samples: int, detector: TurnDetector,
                 video_interval_samples: int | None = None, resends: bool = False) -> None:
        self.rate = rate
        self.core = Session(session_id,
                            video_interval_samples=video_interval_samples or rate // 2)
        self.detector = detector
        # 20 ms frames, as phones and WebRTC play them. `resends`: the carrier can drop what it
        # holds and have it sent again (Twilio's clear), so released audio is kept until heard.
        self.pacer: OutputPacer[Any] = OutputPacer(lead_samples, rate // 50,
                                                   keep_unheard=resends)
        self.model_output_rate = model_output_rate
        # A resume on another node re-primes it from its saved state and it goes on sample for
        # sample, so the model hears what an uninterrupted session's would.
        self._to_model = FirResampler(rate, model_input_rate)
        self.guard = EchoGuard(rate)
        """What the speech detector hears: the microphone less the echo of our own reply."""
        self._input_end = 0
        self._input_lag: int | None = None
        """The least (clock - input received) seen: input that came in that early was captured
        when the clock read its end plus this, whatever the delay of the frames since."""
        self._from_model = Resampler(model_output_rate, rate)
        self.tempo = ReplyTempo(rate)
        """The reply's speed (audio.output.speed), applied as its audio reaches the session
        clock: every count from there on (output samples, marks, truncation, the heard
        watermark, the echo guard's reference) is in the listener's time."""
        self.gate = InputGate(rate, model_input_rate)
        """Holds input back from the model until a turn's speech starts (its owner turns it on
        where speech is detected and turns are taken)."""
        self.heard = HeardAudio(VAD_RATE)
        self.vad_chunk = VAD_CHUNK * rate // VAD_RATE
        """Clock samples behind each speech probability (silero's window at 16 kHz)."""

    # -- input --------------------------------------------------------------------------------

    def input_effects(self, pcm: np.ndarray, *, detect_speech: bool) -> list[EnginePush | VadFeed]:
        """Float32 on the session clock, on its way to the model and the speech detector."""
        out: list[EnginePush | VadFeed] = []
        to_model = self.gate.feed(self._to_model.process(pcm))
        if len(to_model):
            out.append(EnginePush(to_model))
        self._input_end += len(pcm)
        lag = self.core.now_sample - self._input_end
        self._input_lag = lag if self._input_lag is None else min(self._input_lag, lag)
        if detect_speech:
            # The echo in this audio is of what played when it was captured, not when it came
            # in: a late frame would otherwise shift the canceller's reference by its delay.
            playhead = self.pacer.played(self._input_end + self._input_lag)
            replying = (bool(self.pacer) or playhead < self.pacer.tx_samples
                        or self.core.pause is not None)
            heard = self.guard.clean(pcm, playhead)
            self.heard.append(heard)
            # The chunk that brings a pause in the user's speech to a decision starts the
            # reply: it does not wait for other sessions' audio either.
            out.append(VadFeed(heard, urgent=replying or self.detector.deciding(self.vad_chunk)))
        return out

    def released_input(self) -> list[EnginePush]:
        """What a speech start just released of the held input, for the model at once."""
        opened = self.gate.flush()
        return [EnginePush(opened)] if len(opened) else []

    def commit_input(self, asked: bool = False) -> list[EnginePush]:
        """The turn is committed: the model gets what the gate still holds of it first (and,
        when the client `asked` with no speech detected, the input held back)."""
        rest = self.gate.commit(asked)
        return [EnginePush(rest)] if len(rest) else []

    def input_state(self) -> ResamplerState:
        """Where the model's input resampler stands, for a resume to go on from."""
        return self._to_model.state()

    def resume_input(self, state: ResamplerState) -> None:
        r = self._to_model
        self._to_model = FirResampler.resume(r.in_rate, r.out_rate, state)

    def speech_decisions(self, probs: list[float],
                         early: float | None = None) -> Iterator[SpeechCommand]:
        """The detector's decisions, each followed by the chunk's activity (which judges a
        paused reply's interruption), in input order, then what the `early` score of the
        chunk still filling starts. Lazily: a false interruption judged on one chunk ends the
        detector's speech (`forget_speech`) before the next is fed. A speech start releases
        the input held before it (`released_input`)."""
        for prob in probs:
            decision = self.detector.feed(prob, self.vad_chunk)
            if decision is not None:
                yield self._opened(decision)
            yield cmd.VoiceActivity(self.detector.position, prob >= self.detector.threshold)
        if early is not None and (started := self.detector.feed_early(early)) is not None:
            yield self._opened(started)

    def _opened(self, decision: SpeechCommand) -> SpeechCommand:
        if isinstance(decision, cmd.SpeechStarted):
            self.gate.open(max(0, decision.at_sample - self.detector.prefix_samples))
        return decision

    def score_request(self, ask: ScoreTurn) -> ScoreTurnEnd:
        """The audio the end-of-turn model judges: the turn from its onset less the prefix
        padding to the pause now under way (the model keeps its last 8 s)."""
        start = max(0, ask.onset - self.detector.prefix_samples)
        to_heard = VAD_RATE / self.rate
        return ScoreTurnEnd(ask.request, self.heard.window(round(start * to_heard),
                                                           round(ask.end * to_heard)))

    def turn_scored(self, request: int, complete: float | None) -> cmd.SpeechStopped | None:
        """The end-of-turn model's answer: the turn's end, if it is complete."""
        return self.detector.score(request, complete)

    def forget_speech(self) -> None:
        """A false interruption is over: the next speech is a new onset (and a new pause)."""
        self.detector.forget_speech()
        self.gate.forget()

    # -- output -------------------------------------------------------------------------------

    def reply_audio(self, pcm: np.ndarray) -> np.ndarray:
        """Model output onto the session clock."""
        return self._from_model.process(pcm)

    def reply_tail(self) -> np.ndarray:
        """What the resampler still holds at the end of a reply; the next starts clean."""
        tail = self._from_model.process(np.zeros(0, np.float32), last=True)
        self._from_model = Resampler(self.model_output_rate, self.rate)
        return tail

    def reply_pieces(self, pcm: np.ndarray, text: str) -> list[Piece]:
        """Model output and its text onto the session clock at the reply's speed: the audio
        in pieces, each with the text that starts with it."""
        return self.tempo.process(self.reply_audio(pcm), text)

    def reply_end(self) -> list[Piece]:
        """The rest of the reply once the model is done: the resampler's tail, then what the
        tempo filter still holds."""
        return self.tempo.finish(self.reply_tail())

    def due(self, now: int) -> list[tuple[ev.OutputChunk, Any]]:
        """Advance the clock to `now`; the chunks due for release, each recorded as delivered."""
        if now > self.core.now_sample:
            self.core.handle(cmd.Tick(now))
        if self.core.pause is not None:
            return []
        due = self.pacer.due(now)
        if due:
            last = due[-1][0]
            self.core.handle(cmd.OutputDelivered(last.start_sample + last.n_samples))
        return due

    def cancel_effects(self, event: ev.Event) -> list[EngineCancel]:
        """The engine's and the pacer's side of a core event: an epoch bump cancels the old
        epoch's work; a flush drops queued reply audio and the resampler's history of it."""
        if isinstance(event, ev.EpochBumped):
            return [EngineCancel(event.new)]
        if isinstance(event, ev.Flush):
            self.pacer.flush()
            self._from_model = Resampler(self.model_output_rate, self.rate)
            self.tempo.reset()
        return []

    def settle(self) -> None:
        """After core events: the pacer resumes from where the output track now ends."""
        self.pacer.rewind(self.core.sent_samples)
