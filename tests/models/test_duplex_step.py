"""Native full duplex at the model: one frame in, one frame out per lockstep step; a session
batched with neighbours that join and leave gives exactly its output alone; echo's output is its
input delayed by the lag."""

import numpy as np
import pytest

from models.base import is_voiced
from models.echo import EchoModel
from models.moshi.adapter import MoshiAdapter
from models.moshi.tiny import build_tiny

FRAME = 1920


@pytest.fixture(scope="module")
def moshi(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moshi")
    build_tiny(path)
    return MoshiAdapter.from_pretrained(path)


def speech(seed, count):
    """Frames of loud noise with a quiet stretch in the middle: speech, silence, speech."""
    rng = np.random.default_rng(seed)
    frames = [0.3 * rng.standard_normal(FRAME).astype(np.float32) for _ in range(count)]
    for k in range(count // 3, count // 2):
        frames[k] = np.zeros(FRAME, np.float32)
    return frames


def run_alone(model, frames):
    state = model.new_state("alone")
    return [model.duplex_step([state], [f])[0] for f in frames]


def test_moshi_session_with_neighbours_joining_and_leaving_equals_it_alone(moshi):
    steps = 12
    mine = speech(1, steps)
    alone = run_alone(moshi, mine)
    # Neighbours: one there from the start that leaves at step 5, one joining at step 3 that
    # stays, one joining at step 7 for three steps.
    spans = {"a": (0, 5), "b": (3, steps), "c": (7, 10)}
    inputs = {name: speech(10 + i, steps) for i, name in enumerate(spans)}
    states = {"me": moshi.new_state("me")}
    together = []
    for t in range(steps):
        for name, (join, leave) in spans.items():
            if t == join:
                states[name] = moshi.new_state(name)
            if t == leave:
                moshi.free(states.pop(name))
        names = list(states)
        frames = [mine[t] if n == "me" else inputs[n][t] for n in names]
        out = moshi.duplex_step([states[n] for n in names], frames)
        together.append(out[names.index("me")])
    assert len(together) == len(alone) == steps
    for k, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert a.text == b.text, k
        assert a.voiced == b.voiced, k
        assert len(b.pcm) == FRAME
        np.testing.assert_allclose(b.pcm, a.pcm, atol=1e-4, err_msg=f"frame {k}")
    # The first step has no Moshi frame yet (delayed codebooks); every later one is audio.
    assert not together[0].pcm.any()
    assert all(f.pcm.any() for f in together[1:])


def test_moshi_neighbour_that_joins_late_runs_as_if_alone(moshi):
    """A slot reset mid-run: the late joiner's output equals its own run alone."""
    first, late = speech(2, 8), speech(3, 4)
    early = moshi.new_state("early")
    for f in first[:4]:
        moshi.duplex_step([early], [f])
    joiner = moshi.new_state("joiner")
    batched = [moshi.duplex_step([early, joiner], [first[4 + k], late[k]])[1] for k in range(4)]
    for a, b in zip(run_alone(moshi, late), batched, strict=True):
        assert a.text == b.text
        np.testing.assert_allclose(b.pcm, a.pcm, atol=1e-4)


@pytest.mark.parametrize("lag", [1, 3])
def test_echo_duplex_is_its_input_delayed_by_the_lag(lag):
    echo = EchoModel(duplex_lag_frames=lag)
    assert echo.duplex_delay_frames == lag
    frames = speech(4, 9)
    states = [echo.new_state("x"), echo.new_state("y")]
    outs = [echo.duplex_step(states, [f, -f]) for f in frames]
    for k, (x, y) in enumerate(outs):
        source = k - lag + 1
        want = frames[source] if source >= 0 else np.zeros(FRAME, np.float32)
        assert np.array_equal(x.pcm, want) and np.array_equal(y.pcm, -want)
        assert x.voiced == is_voiced(want)
        assert x.text == (f"frame{source} " if x.voiced else "")
    assert echo.bytes_held(states[0]) == (lag - 1) * FRAME * 4
    echo.free(states[0])
    assert echo.bytes_held(states[0]) == 0

