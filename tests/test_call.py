"""`duplex call` against `duplex serve --model echo`, both as a user runs them."""

import re
import subprocess
import sys
import wave

import numpy as np
import pytest

from duplex.bench.synth import babble
from duplex.media import float_to_pcm16

RATE = 24000


@pytest.mark.slow
def test_call_streams_a_file_and_saves_the_echoed_reply(server_process, tmp_path):
    server = server_process("--model", "echo")
    speech = babble(RATE * 2, seed=11)
    source = np.concatenate([np.zeros(RATE // 2, np.float32), speech, np.zeros(RATE, np.float32)])
    infile, outfile = tmp_path / "in.wav", tmp_path / "out.wav"
    with wave.open(str(infile), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(float_to_pcm16(source))
    url = server.url.replace("http", "ws") + "/v1/realtime"
    result = subprocess.run(
        [sys.executable, "-m", "duplex.cli", "call", url, "--input", str(infile), "--output", str(outfile)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "input_audio_buffer.speech_started" in result.stdout
    assert "response.done  completed" in result.stdout
    assert "TTFA (end of speech to first reply audio):" in result.stdout
    with wave.open(str(outfile)) as w:
        reply = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    # The echo replies with what the model heard of the turn: the file from speech_started's
    # audio_start_ms (the onset less the prefix padding, not its first half second) to the
    # commit; after the file, `duplex call` keeps sending silence until the reply is done.
    # semantic_vad asked by default; synthetic speech tells the model nothing, so the turn
    # ended by its fallback wait.
    start_ms = int(re.search(r"speech_started  audio_start_ms (\d+)", result.stdout)[1])
    assert 0 < start_ms < 500
    sent = np.frombuffer(float_to_pcm16(np.concatenate([source, np.zeros(RATE * 6)])), dtype="<i2")
    assert len(reply) > len(speech)
    # The wire rounds the start down to a millisecond.
    start = start_ms * RATE // 1000
    assert any(np.array_equal(reply, sent[start + lag : start + lag + len(reply)])
               for lag in range(RATE // 1000))
