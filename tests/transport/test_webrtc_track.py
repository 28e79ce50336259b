"""The WebRTC reply track on its own: what it plays frame by frame when a reply is held for
speech over it, resumed after a false interruption, or flushed by a barge-in."""

from itertools import count

import numpy as np

from duplex.media.fir import FirResampler
from duplex.transport.webrtc.media import FRAME_24K, RATE, TRACK_RATE, ReplyTrack


async def frames(track: ReplyTrack, n: int) -> list[np.ndarray]:
    return [(await track.recv()).to_ndarray().reshape(-1).astype(np.float32) / 32768
            for _ in range(n)]


def track_with(reply: np.ndarray) -> tuple[ReplyTrack, list[int]]:
    # A clock always past the next frame's time: frames come as fast as they are asked for.
    track = ReplyTrack(clock=count().__next__)
    positions: list[int] = []
    track.on_played = positions.append
    track.play(0, reply)
    return track, positions


def voice(n: int) -> np.ndarray:
    """A rising tone: no two stretches of it alike, so it lines up with itself only once."""
    t = np.arange(n) / RATE
    return (0.4 * np.sin(2 * np.pi * (200 + 1000 * t) * t)).astype(np.float32)


async def test_a_held_track_goes_quiet_at_once_and_resumes_with_the_next_sample():
    reply = voice(RATE)
    track, positions = track_with(reply)
    before = await frames(track, 10)
    track.hold()
    held = await frames(track, 10)
    track.resume()
    after = await frames(track, 45)
    # Positions on the output clock: on to 10 frames, still while held, then on from there;
    # nothing skipped and nothing played twice.
    assert positions == ([FRAME_24K * (i + 1) for i in range(10)] + [10 * FRAME_24K] * 10
                         + [min(RATE, FRAME_24K * (i + 11)) for i in range(45)])
    # Quiet from the first held frame on, but for the resampler's tail already under way (its
    # filter reaches 1.3 ms each side).
    assert np.count_nonzero(held[0]) <= 4 * 64 and not any(np.any(f) for f in held[1:])
    # What it played is the reply with ten frames of silence let in where it was held, and
    # nothing else changed: on the 48 kHz track, after the resampler's 1.3 ms.
    fir = FirResampler(RATE, TRACK_RATE)
    gapped = np.concatenate([reply[: 10 * FRAME_24K], np.zeros(10 * FRAME_24K, np.float32),
                             reply[10 * FRAME_24K :], np.zeros(RATE, np.float32)])
    expected = np.concatenate([np.zeros(fir.lookahead, np.float32), fir.process(gapped)])
    heard = np.concatenate(before + held + after)
    assert np.abs(heard - expected[: len(heard)]).max() < 2 / 32768


async def test_a_flush_drops_what_the_track_holds_and_ends_a_hold():
    track, positions = track_with(voice(RATE))
    await frames(track, 5)
    track.hold()
    await frames(track, 2)
    track.flush()
    assert not track.held
    quiet = await frames(track, 5)
    assert not any(np.any(f) for f in quiet[1:]) and positions[-1] == 5 * FRAME_24K
    # The next reply plays from its own start on the output clock.
    track.play(9600, voice(FRAME_24K * 2))
    await frames(track, 2)
    assert positions[-2:] == [9600 + FRAME_24K, 9600 + 2 * FRAME_24K]
