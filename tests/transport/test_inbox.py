"""A session's inbox: a barge-in, the end, and the client's own events overtake queued reply
audio, and within each class nothing is reordered."""

import asyncio

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from duplex.transport.inbox import (
    CarrierGone,
    EngineOutput,
    Fenced,
    Inbox,
    MediaAudio,
    MediaFrame,
    PeerBytes,
    PeerText,
    Shutdown,
    SpeechProbs,
    Tick,
    TranscriptReady,
)

URGENT = (SpeechProbs, CarrierGone, Shutdown, Fenced)
FROM_PEER = (PeerText, PeerBytes, MediaAudio, MediaFrame)


def message(kind: int, n: int):
    """The n-th message put, of one of every kind there is; `n` tells them apart."""
    return [
        lambda: SpeechProbs([n / 1000]),
        CarrierGone,
        lambda: Shutdown(1001, str(n)),
        Fenced,
        lambda: PeerText(str(n)),
        lambda: PeerBytes(str(n).encode()),
        lambda: MediaAudio(np.full(1, n, np.float32)),
        lambda: MediaFrame(None, n),
        lambda: EngineOutput(n),
        Tick,
        lambda: TranscriptReady(str(n), None),
    ][kind]()


def test_a_barge_in_and_the_clients_cancel_overtake_queued_reply_audio():
    async def run():
        inbox = Inbox()
        for n in range(3):
            inbox.put(EngineOutput(f"audio {n}"))
        inbox.put(Tick())
        inbox.put(PeerText('{"type": "response.cancel"}'))
        inbox.put(SpeechProbs([0.9]))
        return [await inbox.get() for _ in range(inbox.qsize())]

    assert asyncio.run(run()) == [
        SpeechProbs([0.9]), PeerText('{"type": "response.cancel"}'),
        EngineOutput("audio 0"), EngineOutput("audio 1"), EngineOutput("audio 2"), Tick()]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 10), st.none()), max_size=60))
def test_the_most_urgent_class_comes_first_each_in_arrival_order(steps):
    """Puts (a kind) and gets (None) in any order, against three plain FIFOs."""

    async def run():
        inbox = Inbox()
        fifos: list[list] = [[], [], []]
        for n, step in enumerate(steps):
            if step is not None:
                msg = message(step, n)
                rank = 0 if isinstance(msg, URGENT) else 1 if isinstance(msg, FROM_PEER) else 2
                fifos[rank].append(msg)
                inbox.put(msg)
            elif any(fifos):
                expected = next(f for f in fifos if f).pop(0)
                got = await inbox.get()
                assert got is expected
        assert inbox.qsize() == sum(map(len, fifos))

    asyncio.run(run())
