"""Speakerphone clients of `duplex serve --model echo` over the Realtime WebSocket: every reply
they play comes back into their microphone. The echo must not interrupt a reply, a short burst
only pauses it, and real speech over the echo still cuts it."""

import asyncio
import re

import httpx
import numpy as np
import pytest
import websockets

from tests.transcription.fixtures import TEXTS, have_espeak
from tests.transport.echoing_client import RATE, EchoingClient, pcm16, utterance
from tests.transport.hearing import assert_heard_whole, hearing, played_parts

MIN_INTERRUPTION_S = 0.4
PAUSE_WITHIN_S = 0.6
"""Onset to the pause over the echo, with room for a loaded test host. The canceller holds
back the first syllable or so of speech over a loud echo (200-300 ms here); without echo the
pause follows the detector's decision at once (duplex bench measures it: pause_ms)."""


async def conversation(url: str, delay_ms: int, gain_db: float, noise_reduction,
                       with_burst: bool) -> dict:
    """Say something; over the echoed reply, a 150 ms burst (or nothing); then say something
    else, and talk over that reply for real. Returns what was seen, for the test to judge."""
    first, second, interruption = (utterance(TEXTS[i]) for i in (0, 3, 6))
    # A syllable's worth of sound at the microphone, louder than the loudspeaker's echo (a
    # cough, a tongue click, a "hm"): plain clicks are no speech to the detector at all.
    burst = utterance(TEXTS[2])[4000 : 4000 + RATE * 15 // 100]
    burst *= 0.9 / np.abs(burst).max()
    async with websockets.connect(f"{url}/v1/realtime?model=echo", compression=None) as ws:
        c = EchoingClient(ws, delay_ms, gain_db)
        await c.start()
        await c.send(type="session.update", session={"type": "realtime", "duplex_events": True,
                                                     "audio": {"input": {"noise_reduction": (
                                                         noise_reduction and {"type": noise_reduction})}}})
        c.say(first, after_s=0.3)
        _, created = await c.wait_for("response.created")
        reply1 = created["response"]["id"]
        t_audio, _ = await c.wait_for("response.output_audio.delta", response_id=reply1)
        # 0.8 s into the reply: a burst, or nothing.
        burst_at = (c.say(burst, after_s=max(0.04, t_audio + 0.8 - c.now())) if with_burst
                    else None)
        t_done1, done1 = await c.wait_for("response.done", after=t_audio)

        said_at = c.say(second, after_s=0.5)
        _, created = await c.wait_for("response.created", after=said_at)
        reply2 = created["response"]["id"]
        t_audio2, _ = await c.wait_for("response.output_audio.delta", response_id=reply2)
        onset = c.say(interruption, after_s=max(0.04, t_audio2 + 0.8 - c.now()))
        t_done2, done2 = await c.wait_for("response.done", after=t_audio2)
        await c.stop()
    return {"c": c, "first": first, "reply1": reply1, "done1": done1, "t_audio": t_audio,
            "t_done1": t_done1, "burst_at": burst_at, "reply2": reply2, "done2": done2,
            "t_done2": t_done2, "onset": onset}


@pytest.mark.timing
@pytest.mark.slow
async def test_speakerphone_echo_never_interrupts_a_burst_pauses_and_speech_cuts(server_process):
    if not have_espeak():
        pytest.fail("espeak-ng is not installed (make test installs it)")
    server = server_process("--model", "echo")
    url = server.url.replace("http", "ws")
    # A loud, early echo, and a faint, late one through the far-field guard. (A 150 ms burst
    # under an echo as loud as the first is not even heard: the canceller's double-talk
    # suppression takes it, and the reply plays on.)
    runs = await asyncio.gather(conversation(url, 80, -6, None, with_burst=False),
                                conversation(url, 250, -20, "far_field", with_burst=True))
    for r in runs:
        c = r["c"]
        # The echoed reply played whole: no speech was heard over it but the burst, which
        # paused it once; it went on where it paused, so the listener heard all of it (the
        # user's words, exactly, for the echo model), with one gap and no cut.
        assert r["done1"]["response"]["status"] == "completed"
        assert not c.between("input_audio_buffer.speech_started", r["t_audio"], r["t_done1"])
        pauses = [t for t, e in c.events if e["type"] == "duplex.output.paused"
                  and e["response_id"] == r["reply1"]]
        if r["burst_at"] is None:
            assert pauses == []
        else:
            [paused_t] = pauses
            assert r["burst_at"] <= paused_t < r["burst_at"] + PAUSE_WITHIN_S
            assert c.between("duplex.output.resumed", paused_t, r["t_done1"])
            [(gap_from, gap_to)] = c.delivery_gaps(r["reply1"])
            assert gap_from <= paused_t + 0.1 and gap_to > r["burst_at"] + 0.15
        assert pcm16(r["first"]) in c.reply_audio(r["reply1"])
        # And the listener played all of it, in one part or two around the burst's pause.
        parts = played_parts(c.playout, r["reply1"])
        assert len(parts) == (1 if r["burst_at"] is None else 2)
        assert_heard_whole(hearing(parts, r["first"], RATE))
        words = r["done1"]["response"]["output"][0]["content"][0]["transcript"].split()
        assert len(c.reply_audio(r["reply1"])) // 2 == pytest.approx(len(words) * 1920, abs=1920)

        # Speech over the echo: the reply pauses at once and is cut once the speech has lasted.
        assert r["done2"]["response"]["status"] == "cancelled"
        assert r["done2"]["response"]["status_details"]["reason"] == "turn_detected"
        onset = r["onset"]
        last_audio = max(t for t, rid, _ in c.deltas if rid == r["reply2"])
        stop = c.playout.stopped(int(onset * RATE), r["reply2"])
        print(f"speech over echo: last audio sent {1000 * (last_audio - onset):.0f} ms, last "
              f"played {1000 * (stop / RATE - onset):.0f} ms, cut "
              f"{1000 * (r['t_done2'] - onset):.0f} ms after its onset")
        assert last_audio < onset + PAUSE_WITHIN_S
        assert onset + MIN_INTERRUPTION_S <= r["t_done2"] < onset + MIN_INTERRUPTION_S + 1.0
        started = c.between("input_audio_buffer.speech_started", onset, r["t_done2"])
        assert len(started) == 1
        # Announced from where the detector heard it begin (300 ms of prefix before that).
        heard_from = started[0]["audio_start_ms"] / 1000 + 0.3
        assert onset - 0.1 < heard_from < onset + PAUSE_WITHIN_S

    metrics = httpx.get(f"{server.url}/metrics").text
    counts = {name: float(re.search(rf"^duplex_{name}_total (\S+)$", metrics, re.M)[1])
              for name in ("interruptions", "false_interruptions")}
    # Each talked-over reply was cut once, and the burst was a false interruption. (Speech
    # over a loud echo may also pause, resume and pause again before the cut: the canceller
    # can hold back its first syllable for longer than the 200 ms that ends a pause.)
    print(f"metrics: {counts}")
    assert counts["interruptions"] == 2.0 and counts["false_interruptions"] >= 1.0
