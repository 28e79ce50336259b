"""Stage timers: host wall time for a CPU model; for a CUDA model the device's time between the
events around each call, read back in call order without waiting until a report asks."""

from __future__ import annotations

from duplex.engine.timing import StageClock


class _Event:
    """A CUDA event as the timer uses it, on a device whose stream the test advances."""

    stream: list[_Event] = []
    reached = 0
    """Events the device has passed, in record order."""

    def record(self) -> None:
        self.index = len(self.stream)
        self.stream.append(self)

    def query(self) -> bool:
        return self.index < _Event.reached

    def synchronize(self) -> None:
        _Event.reached = max(_Event.reached, self.index + 1)

    def elapsed_time(self, end: _Event) -> float:
        return 10.0 * (end.index - self.index)


def test_a_cpu_model_is_timed_by_the_host_clock():
    now = iter([1.0, 1.25])
    timer = StageClock("cpu", clock=lambda: next(now))
    ms: list[float] = []
    with timer.timed(ms):
        pass
    assert ms == [250.0]


def test_a_cuda_model_is_timed_by_its_events_collected_without_waiting():
    _Event.stream, _Event.reached = [], 0
    timer = StageClock("cuda:0", clock=lambda: 0.0, event=_Event)
    thinker: list[float] = []
    codec: list[float] = []
    with timer.timed(thinker):
        pass
    with timer.timed(codec):
        _Event().record()  # the codec's own work: two events apart
    assert thinker == codec == []
    timer.collect()
    assert thinker == codec == []
    _Event.reached = 2  # the device passed the Thinker's call, not yet the codec's
    timer.collect()
    assert thinker == [10.0] and codec == []
    timer.collect(wait=True)
    assert codec == [20.0]
