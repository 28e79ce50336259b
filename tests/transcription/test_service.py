"""The service answers every request once, on its own callback, whatever happens to it."""

import asyncio
import logging
import threading

import numpy as np
import pytest

from duplex.transcription import (
    INVALID_AUDIO,
    QUEUE_FULL,
    RECOGNITION_FAILED,
    STOPPED,
    Recognizer,
    TranscriptionResult,
    TranscriptionService,
)
from tests.waiting import eventually, until


class Counting(Recognizer):
    """Says how many samples it heard; can be held inside a recognition until released."""

    def __init__(self, name: str = "counting", hold: bool = False) -> None:
        super().__init__(name)
        self.batches: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def _load(self) -> None:
        pass

    def _recognize(self, pcms, hints):
        self.batches.append(len(pcms))
        self.entered.set()
        assert self.release.wait(10)
        return [f"{len(p)} samples" for p in pcms]


class Failing(Recognizer):
    def _load(self) -> None:
        pass

    def _recognize(self, pcms, hints):
        raise RuntimeError("the model fell over")


class Results:
    """Collects results per request, and on which thread each arrived."""

    def __init__(self) -> None:
        self.by_key: dict[str, TranscriptionResult] = {}
        self.threads: dict[str, str] = {}
        self._cond = threading.Condition()

    def callback(self, key: str):
        def deliver(result: TranscriptionResult) -> None:
            with self._cond:
                assert key not in self.by_key, f"{key} answered twice"
                self.by_key[key] = result
                self.threads[key] = threading.current_thread().name
                self._cond.notify_all()

        return deliver

    def wait(self, count: int) -> dict[str, TranscriptionResult]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.by_key) >= count, timeout=10)
            return dict(self.by_key)


def pcm(n: int) -> np.ndarray:
    return np.zeros(n, np.float32)


@pytest.fixture
def service():
    s = TranscriptionService(max_queue=4, max_batch=8)
    yield s
    s.stop()


def test_concurrent_requests_share_one_batch_and_each_gets_its_own_result(service):
    model = Counting(hold=True)
    results = Results()
    service.submit(model, pcm(100), results.callback("first"))
    assert model.entered.wait(10)
    # While the worker is busy, four sessions submit from their own threads.
    submitters = [
        threading.Thread(target=service.submit, args=(model, pcm(n), results.callback(f"s{n}")))
        for n in (201, 202, 203, 204)
    ]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join()
    model.release.set()
    got = results.wait(5)
    assert model.batches == [1, 4]
    assert got["first"].text == "100 samples"
    for n in (201, 202, 203, 204):
        assert got[f"s{n}"].ok and got[f"s{n}"].text == f"{n} samples"
        assert got[f"s{n}"].model == "counting"
        assert got[f"s{n}"].audio_s == pytest.approx(n / 16000)
    assert set(results.threads.values()) == {"duplex-asr"}


def test_requests_for_different_recognisers_in_one_batch_go_to_their_own(service):
    hold, a, b = Counting("hold", hold=True), Counting("a"), Counting("b")
    results = Results()
    service.submit(hold, pcm(1), results.callback("hold"))
    assert hold.entered.wait(10)
    for i, model in enumerate([a, b, a]):
        service.submit(model, pcm(10 + i), results.callback(f"r{i}"))
    hold.release.set()
    got = results.wait(4)
    assert (a.batches, b.batches) == ([2], [1])
    assert [got[f"r{i}"].model for i in range(3)] == ["a", "b", "a"]
    assert [got[f"r{i}"].text for i in range(3)] == ["10 samples", "11 samples", "12 samples"]


def test_a_full_queue_answers_at_once_with_an_error_instead_of_raising(service):
    model = Counting(hold=True)
    results = Results()
    service.submit(model, pcm(1), results.callback("running"))
    assert model.entered.wait(10)
    for i in range(service.max_queue):
        service.submit(model, pcm(2), results.callback(f"queued{i}"))
    service.submit(model, pcm(3), results.callback("refused"))
    refused = results.by_key["refused"]  # answered before submit returned
    assert not refused.ok and refused.error.code == QUEUE_FULL
    assert "already waiting" in refused.error.message
    assert results.threads["refused"] == threading.current_thread().name
    model.release.set()
    got = results.wait(service.max_queue + 2)
    assert all(got[f"queued{i}"].ok for i in range(service.max_queue))
    # Room again once the worker has taken them.
    service.submit(model, pcm(4), results.callback("later"))
    assert results.wait(service.max_queue + 3)["later"].ok


def test_a_failing_recogniser_gives_error_results_and_the_service_goes_on(service, caplog):
    results = Results()
    failing = Failing("failing")
    for i in range(3):
        service.submit(failing, pcm(10), results.callback(f"f{i}"))
    got = results.wait(3)
    for i in range(3):
        assert got[f"f{i}"].error.code == RECOGNITION_FAILED
        assert got[f"f{i}"].error.message == "RuntimeError: the model fell over"
        assert got[f"f{i}"].text == ""
    service.submit(Counting(), pcm(5), results.callback("after"))
    assert results.wait(4)["after"].text == "5 samples"
    # The operator is told too: an error record with the recogniser's traceback.
    assert any(r.name == "duplex.transcription" and r.levelno == logging.ERROR and r.exc_info
               for r in caplog.records)


def test_unusable_audio_is_refused_on_the_spot(service):
    results = Results()
    service.submit(Counting(), np.zeros((2, 100), np.float32), results.callback("stereo"))
    service.submit(Counting(), np.array([0.0, np.nan], np.float32), results.callback("nan"))
    assert results.by_key["stereo"].error.code == INVALID_AUDIO
    assert "mono" in results.by_key["stereo"].error.message
    assert results.by_key["nan"].error.code == INVALID_AUDIO


def test_a_callback_that_raises_does_not_stop_the_worker(service):
    results = Results()

    def broken(result):
        raise RuntimeError("session gone")

    service.submit(Counting(), pcm(1), broken)
    service.submit(Counting(), pcm(2), results.callback("next"))
    assert results.wait(1)["next"].text == "2 samples"


def test_stop_answers_waiting_requests_and_refuses_new_ones():
    service = TranscriptionService()
    model = Counting(hold=True)
    results = Results()
    service.submit(model, pcm(1), results.callback("running"))
    assert model.entered.wait(10)
    service.submit(model, pcm(2), results.callback("waiting"))
    stopper = threading.Thread(target=service.stop)
    stopper.start()
    probes = 0

    def refused_at_once() -> bool:
        """Once a request is refused before submit returns, stop() has closed the door."""
        nonlocal probes
        service.submit(model, pcm(3), results.callback(f"probe{probes}"))
        probes += 1
        return f"probe{probes - 1}" in results.by_key

    until(refused_at_once, "stop() refuses new requests")
    model.release.set()
    stopper.join(10)
    got = results.wait(2 + probes)
    assert got["running"].ok
    assert got["waiting"].error.code == STOPPED
    assert all(got[f"probe{i}"].error.code == STOPPED for i in range(probes))


async def test_the_event_loop_runs_on_while_the_worker_recognises(service):
    model = Counting(hold=True)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    tick_task = asyncio.create_task(ticker())
    pending = asyncio.create_task(service.transcribe(model, pcm(7)))
    await asyncio.to_thread(model.entered.wait, 10)
    before = ticks
    # The loop is not blocked by the held recognition: it keeps ticking.
    assert await eventually(lambda: ticks > before + 10, "the event loop ticks on")
    model.release.set()
    result = await asyncio.wait_for(pending, 10)
    tick_task.cancel()
    assert result.ok and result.text == "7 samples"
