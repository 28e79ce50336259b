"""audio.output.speed over the wire: the official SDK against `duplex serve --model echo`, whose
reply is the user's audio (one transcript word per 80 ms frame of it)."""

import base64

import numpy as np
import pytest

from tests.media.test_tempo import dominant_hz
from tests.transport.sdk import client_for, events_until

RATE = 24000
FRAME = 1920
"""The echo model's frame: one word of its transcript ("frame0 frame1 ...")."""


@pytest.mark.slow
async def test_a_faster_reply_is_shorter_keeps_its_pitch_and_is_cut_where_heard(server_process):
    server = server_process("--model", "echo")
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(2 * RATE) / RATE)
    said = (tone * 32767).astype("<i2").tobytes()
    async with client_for(server).realtime.connect(model="echo") as conn:
        await conn.session.update(session={"type": "realtime", "audio": {
            "input": {"turn_detection": None}, "output": {"speed": 1.5}}})
        await events_until(conn, "session.updated")
        await conn.input_audio_buffer.append(audio=base64.b64encode(said).decode())
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await events_until(conn, "response.done")
        heard = np.frombuffer(b"".join(base64.b64decode(e.delta) for e in events
                                       if e.type == "response.output_audio.delta"), "<i2")
        # 2 s said, 1.33 s heard, at the same pitch.
        assert len(heard) == pytest.approx(len(tone) / 1.5, rel=0.05)
        assert dominant_hz(heard / 32767) == pytest.approx(440, rel=0.02)
        done = events[-1].response
        assert done.status == "completed"
        assert done.output[0].content[0].transcript.split() == [f"frame{k}" for k in range(25)]

        # The listener stopped 500 ms in: 750 ms of the reply at its own tempo, so the words
        # of its first 10 frames (at speed 1 it would be 7).
        item_id = done.output[0].id
        await conn.conversation.item.truncate(item_id=item_id, content_index=0,
                                              audio_end_ms=500)
        truncated = (await events_until(conn, "conversation.item.truncated"))[-1]
        assert truncated.audio_end_ms == 500
        await conn.conversation.item.retrieve(item_id=item_id)
        item = (await events_until(conn, "conversation.item.retrieved"))[-1].item
        assert item.content[0].transcript.split() == [f"frame{k}" for k in range(10)]
