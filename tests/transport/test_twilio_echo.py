"""A caller on a speakerphone through the Twilio bridge (`duplex serve --model echo`): what it
plays comes back into its microphone 150 ms later, 10 dB down, filtered. The echo must not
interrupt the reply; a short burst only pauses it (Twilio's `clear` at once) and the caller
hears all of it; the caller's speech over the echo stops what the phone plays at once and cuts
the reply."""

import asyncio
import time

import httpx
import numpy as np
import pytest
import websockets

from tests.transcription.fixtures import TEXTS, have_espeak
from tests.transport.echoing_client import LOUDSPEAKER, utterance
from tests.transport.hearing import assert_heard_whole, hearing, played_parts
from tests.transport.test_twilio_call import (
    FRAME,
    FRAME_S,
    RATE,
    SID,
    Peer,
    decoded,
    mulaw,
    wait_until,
)

DELAY_S = 0.15
GAIN = 10 ** (-10 / 20)
PAUSE_WITHIN_S = 0.6
"""Onset to the pause over the echo, with room for a loaded test host (the canceller may hold
back the first syllable of speech over a loud echo)."""


class SpeakerphonePeer(Peer):
    """Every 20 ms frame it sends carries, besides what its caller says, what its loudspeaker
    played DELAY_S before. Its microphone never stops: frames follow each other on the phone's
    clock, and any a late wake-up skipped go out too (the echo alone), so the echo runs on
    without a seam and the stream keeps time, as a phone's does."""

    captured: int | None = None
    """The phone's clock at the end of the last frame captured."""

    def loudspeaker(self, start: int) -> np.ndarray:
        """What the microphone hears of the loudspeaker in the frame from clock sample `start`."""
        at = start - round(DELAY_S * RATE)
        return np.convolve(self.playout.between(at - 2, at + FRAME + 2), LOUDSPEAKER, "valid") * GAIN

    async def speak(self, signal: np.ndarray) -> None:
        signal = np.pad(signal, (0, -len(signal) % FRAME))
        for i in range(0, len(signal), FRAME):
            self.next_frame_at = max(self.next_frame_at + FRAME_S, time.time() - FRAME_S)
            await asyncio.sleep(max(0.0, self.next_frame_at - time.time()))
            end = self.clock(self.next_frame_at)
            if self.captured is None:
                self.captured = end - FRAME
            while end - self.captured >= 2 * FRAME:
                self.media(mulaw(self.loudspeaker(self.captured)))
                self.captured += FRAME
            self.media(mulaw(signal[i : i + FRAME] + self.loudspeaker(self.captured)))
            self.captured += FRAME


@pytest.mark.timing
@pytest.mark.slow
async def test_a_speakerphone_call_hears_whole_replies_through_a_burst_and_is_cut_by_speech(
        server_process):
    if not have_espeak():
        pytest.fail("espeak-ng is not installed (make test installs it)")
    server = server_process("--model", "echo")
    silence = np.zeros(RATE, np.float32)
    burst = utterance(TEXTS[2], RATE)[1300 : 1300 + RATE * 15 // 100]
    burst *= 0.9 / np.abs(burst).max()
    first = utterance(TEXTS[0], RATE)
    ws_url = server.url.replace("http", "ws") + "/telephony/twilio"
    async with websockets.connect(ws_url, compression=None) as ws:
        peer = SpeakerphonePeer(ws)
        peer.start()
        peer.put({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        peer.put({"event": "start", "sequenceNumber": "1", "streamSid": SID, "start": {
            "streamSid": SID, "accountSid": "AC0", "callSid": "CA0", "tracks": ["inbound"],
            "customParameters": {},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
        peer.seq = 1
        peer.next_frame_at = time.time()
        await peer.speak(np.concatenate([silence[: RATE // 5], first]))

        # The reply plays and echoes; 0.8 s in, a burst; then it must play to its end.
        await wait_until(lambda: peer.heard_s() >= 0.8, 10.0, "the reply", peer)
        burst_sent = time.time()
        await peer.speak(burst)
        await wait_until(lambda: time.time() > max(peer.media_in[-1][0] + 1.0,
                                                   peer.playing_until() + 0.5),
                         20.0, "the reply's end and its playback", peer)
        first_marks = {name for _, name in peer.marks_in}
        burst_clears = list(peer.clears)

        # Speech over the echo of the next reply, half a second into it: paused and cleared at
        # once, then cut.
        await peer.speak(utterance(TEXTS[3], RATE))
        await wait_until(lambda: (r := peer.playout.tag_at(peer.clock())) not in (None, 0)
                         and peer.clock() - peer.playout.first[r] > RATE // 2,
                         20.0, "half a second of the next reply", peer)
        reply, onset = peer.playout.tag_at(peer.clock()), peer.clock()
        await peer.speak(utterance(TEXTS[6], RATE))
        await wait_until(lambda: len(peer.clears) > len(burst_clears), 10.0, "a clear", peer)
        await peer.speak(silence[: RATE // 5])
        await peer.hang_up({"event": "stop", "streamSid": SID,
                            "stop": {"accountSid": "AC0", "callSid": "CA0"}}, 10.0)

    # The burst paused the first reply: the phone's buffer was cleared at the pause, and every
    # mark of the reply came back (played, or dropped by a clear); the reply went on from where
    # the caller stopped hearing it, and the caller heard it whole. Its own echo, coming back
    # after the gap, can pause it again now and then (the canceller lets the first 40-80 ms of
    # an echo through after a silent spell): then it resumes again, and is still heard whole.
    assert burst_sent < burst_clears[0] < burst_sent + PAUSE_WITHIN_S
    played = {name for _, name in peer.played if name.startswith("duplex.r0.")}
    dropped = {name for name in peer.dropped_marks if name.startswith("duplex.r0.")}
    assert dropped and not played & dropped and first_marks == played | dropped
    parts = played_parts(peer.playout, 0)
    assert len(parts) == len(burst_clears) + 1
    reference = decoded(mulaw(first))
    heard = hearing(parts, reference, RATE)
    print(f"first reply heard in {len(parts)} parts: {heard}")
    assert_heard_whole(heard)

    # The second was cut by the caller's speech: the clear came at the pause, shortly after
    # its onset, and the phone played nothing of the reply past it (a loaded host may have let
    # it run dry just before).
    speech_clear = peer.clock(peer.clears[len(burst_clears)])
    stop = max(s.end for s in peer.playout.segments if s.tag == reply)
    assert stop <= speech_clear < onset + PAUSE_WITHIN_S * RATE
    print(f"speech over the echo: the caller heard the reply until {1000 * (stop - onset) / RATE:.0f}"
          " ms after its onset")
    # The speech was the one real interruption: neither the burst nor the echo cut a reply.
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{server.url}/metrics")).text
    assert "duplex_interruptions_total 1.0" in metrics
    assert f"duplex_false_interruptions_total {float(len(burst_clears))}" in metrics
