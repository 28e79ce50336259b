"""A turn is its speech: what the model hears of a committed user turn starts at its speech
onset less prefix_padding_ms, where speech_started's audio_start_ms says it does, barge-in
turns included; the silence before it is never given to the model. Driven through the pure
protocol cores, with the speech detector's probabilities given."""

import base64
import json

import numpy as np

from duplex.media import g711_to_float, ulaw_encode
from duplex.transport.effects import EngineCommit, EnginePush, Send
from duplex.transport.realtime.protocol import RealtimeProtocol
from duplex.transport.twilio.protocol import FRAME as TWILIO_FRAME
from duplex.transport.twilio.protocol import Options, TwilioProtocol

RATE = 24000
CHUNK = 768
"""Clock samples behind one speech probability (512 at 16 kHz)."""
PREFIX = 300 * RATE // 1000
SPEECH, QUIET = 0.9, 0.1


class Caller:
    """Feeds a Realtime core 20 ms frames of `audio` on its clock and the detector's verdicts
    chunk by chunk, as the session loop would; keeps every effect."""

    def __init__(self, p: RealtimeProtocol, audio: np.ndarray) -> None:
        self.p, self.audio = p, audio
        self.fed = 0
        self.scored = 0
        self.effects: list = []

    def until(self, sample: int, speech: tuple[int, int] | None = None) -> None:
        """Feed audio up to `sample`, and a probability for each whole chunk of it: speech
        inside the span `speech`."""
        while self.fed < sample:
            n = min(RATE // 50, sample - self.fed)
            self.effects += self.p.release_output(self.fed + n)
            self.effects += self.p.receive_audio(self.audio[self.fed : self.fed + n])
            self.fed += n
        probs = []
        while self.scored + CHUNK <= self.fed:
            inside = speech is not None and speech[0] <= self.scored < speech[1]
            probs.append(SPEECH if inside else QUIET)
            self.scored += CHUNK
        self.effects += self.p.on_vad(probs)

    def pushed(self, since: int = 0) -> np.ndarray:
        parts = [e.pcm for e in self.effects[since:] if isinstance(e, EnginePush)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def events(self, type_: str) -> list[dict]:
        return [e.event for e in self.effects if isinstance(e, Send) and e.event["type"] == type_]


def test_the_model_hears_a_turn_from_its_onset_less_the_prefix_and_nothing_before():
    p = RealtimeProtocol("s", model="m", model_input_rate=RATE, model_output_rate=RATE)
    rng = np.random.default_rng(1)
    audio = rng.uniform(-0.5, 0.5, 10 * RATE).astype(np.float32)
    onset = 80 * CHUNK
    c = Caller(p, audio)
    c.until(onset)
    assert not len(c.pushed()), "silence before any speech reached the model"
    c.until(onset + 52 * CHUNK, speech=(onset, onset + 30 * CHUNK))
    committed = c.events("input_audio_buffer.committed")
    assert committed and any(isinstance(e, EngineCommit) for e in c.effects)
    (started,) = c.events("input_audio_buffer.speech_started")
    assert started["audio_start_ms"] == (onset - PREFIX) * 1000 // RATE
    # Everything before the commit, from the onset less the prefix: sample for sample.
    commit_at = next(i for i, e in enumerate(c.effects) if isinstance(e, EngineCommit))
    heard = c.pushed()[: len(np.concatenate(
        [e.pcm for e in c.effects[:commit_at] if isinstance(e, EnginePush)]))]
    assert np.array_equal(heard, audio[onset - PREFIX : onset - PREFIX + len(heard)])
    assert len(heard) >= 30 * CHUNK + PREFIX


def test_a_barge_in_turn_starts_at_its_own_onset_not_at_the_last_commit():
    p = RealtimeProtocol("s", model="m", model_input_rate=RATE, model_output_rate=RATE)
    rng = np.random.default_rng(2)
    audio = rng.uniform(-0.5, 0.5, 20 * RATE).astype(np.float32)
    c = Caller(p, audio)
    first = 20 * CHUNK
    c.until(first + 30 * CHUNK, speech=(first, first + 10 * CHUNK))
    epoch = next(e.epoch for e in c.effects if isinstance(e, EngineCommit))
    # A long reply plays; 4 s into it the caller talks over it for real.
    p.on_engine_audio(epoch, np.zeros(10 * RATE, np.float32), "reply")
    mark = len(c.effects)
    onset = c.fed + 4 * RATE // CHUNK * CHUNK
    c.until(onset)
    assert not len(c.pushed(mark)), "the quiet while the reply played reached the model"
    c.until(onset + 60 * CHUNK, speech=(onset, onset + 40 * CHUNK))
    started = c.events("input_audio_buffer.speech_started")[-1]
    assert started["audio_start_ms"] == (onset - PREFIX) * 1000 // RATE
    heard = c.pushed(mark)
    assert np.array_equal(heard, audio[onset - PREFIX : onset - PREFIX + len(heard)])
    assert len(heard) >= 40 * CHUNK + PREFIX


def test_without_turn_detection_the_model_hears_everything_as_it_comes():
    p = RealtimeProtocol("s", model="m", model_input_rate=RATE, model_output_rate=RATE)
    p.receive_text('{"type": "session.update", "session": {"type": "realtime", '
                   '"audio": {"input": {"turn_detection": null}}}}')
    audio = np.random.default_rng(3).uniform(-0.5, 0.5, RATE).astype(np.float32)
    c = Caller(p, audio)
    c.until(RATE)
    assert np.array_equal(c.pushed(), audio)


def test_a_twilio_turn_and_a_barge_in_start_at_the_onset_less_the_prefix():
    rate, chunk, prefix = 8000, 256, 300 * 8000 // 1000
    p = TwilioProtocol("call", model_input_rate=rate, model_output_rate=rate,
                       options=Options(turn_detection="server_vad", min_interruption_ms=0))
    p.receive_text('{"event": "start", "sequenceNumber": "1", "streamSid": "MZ1", "start": '
                   '{"streamSid": "MZ1", "accountSid": "AC1", "callSid": "CA1", "tracks": '
                   '["inbound"], "customParameters": {}, "mediaFormat": {"encoding": '
                   '"audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}')
    rng = np.random.default_rng(4)
    mulaw = ulaw_encode((rng.uniform(-0.5, 0.5, 30 * rate) * 32767).astype(np.int16))
    audio = g711_to_float(mulaw, "ulaw")
    effects: list = []
    fed = scored = 0
    seq = 1

    def until(sample, speech=None):
        nonlocal fed, scored, seq
        while fed < sample:
            seq += 1
            payload = mulaw[fed : fed + TWILIO_FRAME]
            effects.extend(p.release_output(fed))
            effects.extend(p.receive_text(json.dumps({
                "event": "media", "sequenceNumber": str(seq), "streamSid": "MZ1",
                "media": {"track": "inbound", "chunk": str(seq), "timestamp": "0",
                          "payload": base64.b64encode(payload).decode()}})))
            fed += TWILIO_FRAME
        probs = []
        while scored + chunk <= fed:
            probs.append(SPEECH if speech and speech[0] <= scored < speech[1] else QUIET)
            scored += chunk
        effects.extend(p.on_vad(probs))

    def pushed(since=0):
        parts = [e.pcm for e in effects[since:] if isinstance(e, EnginePush)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    onset = 50 * chunk
    until(onset + 40 * chunk, speech=(onset, onset + 20 * chunk))
    heard = pushed()
    assert len(heard) >= 20 * chunk + prefix
    assert np.allclose(heard, audio[onset - prefix : onset - prefix + len(heard)], atol=1e-6)
    epoch = next(e.epoch for e in effects if isinstance(e, EngineCommit))
    p.on_engine_audio(epoch, np.zeros(10 * rate, np.float32), "reply")
    mark = len(effects)
    onset = (fed + 3 * rate) // chunk * chunk
    until(onset)
    assert not len(pushed(mark))
    until(onset + 40 * chunk, speech=(onset, onset + 20 * chunk))
    heard = pushed(mark)
    assert len(heard) >= 20 * chunk + prefix
    assert np.allclose(heard, audio[onset - prefix : onset - prefix + len(heard)], atol=1e-6)


def test_a_commit_the_client_asks_for_before_any_speech_is_heard_gives_the_model_the_buffer():
    """OpenAI commits the whole buffer: audio the detector has not yet judged (or found no
    speech in) goes to the model with the commit, up to the 3 s held back."""
    p = RealtimeProtocol("s", model="m", model_input_rate=RATE, model_output_rate=RATE)
    audio = np.random.default_rng(5).uniform(-0.5, 0.5, RATE).astype(np.float32)
    c = Caller(p, audio)
    for start in range(0, RATE, RATE // 50):
        c.effects += p.release_output(start + RATE // 50)
        c.effects += p.receive_audio(audio[start : start + RATE // 50])
    assert not len(c.pushed())
    c.effects += p.receive_text('{"type": "input_audio_buffer.commit"}')
    assert np.array_equal(c.pushed(), audio)
    assert c.events("input_audio_buffer.committed")
