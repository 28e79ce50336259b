"""A caller on a speakerphone through the Twilio bridge (`duplex serve --model echo`): what it
plays comes back into its microphone 150 ms later, 10 dB down, filtered. The echo must not
interrupt the reply, a short burst only pauses it, and the caller's speech over the echo cuts
it (Twilio's `clear`)."""

import asyncio
import time

import httpx
import numpy as np
import pytest
import websockets

from tests.transcription.fixtures import TEXTS, have_espeak
from tests.transport.echoing_client import LOUDSPEAKER, utterance
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


class SpeakerphonePeer(Peer):
    """Every 20 ms frame it sends carries, besides what its caller says, the reply frame it was
    playing DELAY_S before (played from arrival, back to back; a clear drops what is queued)."""

    def playing_at(self, t: float) -> np.ndarray:
        end = 0.0
        for arrived, payload in self.media_in:
            start = max(end, arrived)
            if any(arrived <= c <= start for c in self.clears):
                continue
            end = start + FRAME_S
            if start <= t < end:
                return decoded(payload)
        return np.zeros(FRAME, np.float32)

    async def speak(self, signal: np.ndarray) -> None:
        signal = np.pad(signal, (0, -len(signal) % FRAME))
        for i in range(0, len(signal), FRAME):
            self.next_frame_at = max(self.next_frame_at + FRAME_S, time.time() - FRAME_S)
            await asyncio.sleep(max(0.0, self.next_frame_at - time.time()))
            heard = self.playing_at(time.time() - DELAY_S)
            echo = np.convolve(heard, LOUDSPEAKER, mode="same") * GAIN
            self.media(mulaw(signal[i : i + FRAME] + echo))


@pytest.mark.timing
@pytest.mark.slow
async def test_a_speakerphone_call_hears_whole_replies_pauses_for_a_burst_and_is_cut_by_speech(
        server_process):
    if not have_espeak():
        pytest.fail("espeak-ng is not installed (make test installs it)")
    server = server_process("--model", "echo")
    silence = np.zeros(RATE, np.float32)
    burst = utterance(TEXTS[2], RATE)[1300 : 1300 + RATE * 15 // 100]
    burst *= 0.9 / np.abs(burst).max()
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
        await peer.speak(np.concatenate([silence[: RATE // 5], utterance(TEXTS[0], RATE)]))

        # The reply plays and echoes; 0.8 s in, a burst; then it must play to its end.
        await wait_until(lambda: peer.heard_s() >= 0.8, 10.0, "the reply", peer)
        burst_sent = time.time()
        await peer.speak(burst)
        await wait_until(lambda: time.time() > max(peer.media_in[-1][0] + 1.0,
                                                   peer.play_end + 0.5),
                         20.0, "the reply's end and its playback", peer)
        first_reply = list(peer.media_in)
        first_marks = {name for _, name in peer.marks_in}
        # Heard whole: no clear, and every mark that followed its audio came back as played.
        assert not peer.clears and not peer.dropped_marks
        assert first_marks == {name for _, name, _ in peer.played}

        # Speech over the echo of the next reply: paused, then cleared.
        await peer.speak(utterance(TEXTS[3], RATE))
        await wait_until(lambda: len(peer.media_in) > len(first_reply) + 40, 20.0,
                         "the second reply", peer)
        onset_sent = time.time()
        await peer.speak(utterance(TEXTS[6], RATE))
        await wait_until(lambda: peer.clears, 10.0, "a clear", peer)
        await peer.speak(silence[: RATE // 5])
        await peer.hang_up({"event": "stop", "streamSid": SID,
                            "stop": {"accountSid": "AC0", "callSid": "CA0"}}, 10.0)

    # The first reply was paused once and resumed: one gap in its audio after the burst.
    gaps = [b - a for (a, _), (b, _) in zip(first_reply, first_reply[1:], strict=False)
            if b - a > 0.25 and a > burst_sent]
    assert len(gaps) == 1
    # The second was cut by the caller's speech: one clear, after the speech had lasted.
    [clear_at] = peer.clears
    assert 0.4 <= clear_at - onset_sent < 0.4 + 1.2
    # The burst was the one false interruption and the speech the one real one: nothing of the
    # echo counted as speech.
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{server.url}/metrics")).text
    assert "duplex_interruptions_total 1.0" in metrics
    assert "duplex_false_interruptions_total 1.0" in metrics
