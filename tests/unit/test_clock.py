"""The timing seam (`pipeline.clock`) on a fake CUDA device whose kernels return when queued: the calibration's
timings and the trace's spans measure the device's work, not its launches."""

from __future__ import annotations

import pytest

from pipetrain.bench import calibrate_timing
from pipetrain.pipeline.clock import CudaClock, HostClock, clock_for
from pipetrain.pipeline.timeline import Recorder, span

MS = 1_000_000  # ns


class FakeGpu:
    """A device that runs queued work after the call returns: launching costs the host 1 µs, the work `ms`."""

    def __init__(self) -> None:
        self.host = 0  # host clock, ns
        self.done = 0  # device time at which everything queued so far is finished, ns
        self.syncs = 0

    def host_ns(self) -> int:
        return self.host

    def launch(self, ms: float) -> None:
        self.host += 1000
        self.done = max(self.done, self.host) + round(ms * MS)

    def synchronize(self) -> None:
        self.syncs += 1
        self.host = max(self.host, self.done)

    def event(self) -> "FakeEvent":
        return FakeEvent(self)

    def clock(self) -> CudaClock:
        return CudaClock(event=self.event, synchronize=self.synchronize, host_ns=self.host_ns)


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu, self.at = gpu, None

    def record(self) -> None:
        self.at = max(self.gpu.done, self.gpu.host)  # fires once the work queued before it is done

    def elapsed_time(self, other: "FakeEvent") -> float:
        assert self.at is not None and other.at is not None
        return (other.at - self.at) / MS


def test_seconds_wait_for_the_queued_work():
    gpu = FakeGpu()
    assert gpu.clock().seconds(lambda: gpu.launch(5)) == pytest.approx(5e-3, rel=1e-3)
    assert gpu.syncs == 2  # before (an idle device) and after (the work done)
    host = HostClock()
    assert host.seconds(lambda: gpu.launch(5)) < 1e-3  # what the calibration measured before: the launch


def test_the_calibration_times_through_the_clock():
    gpu = FakeGpu()
    seconds = calibrate_timing.median_time(lambda: gpu.launch(2), 3, gpu.clock())
    assert seconds == pytest.approx(2e-3, rel=1e-2)


def test_trace_spans_are_device_time_resolved_after_the_step():
    gpu = FakeGpu()
    recorder = Recorder(clock=gpu.clock())
    with recorder.recording(0):
        gpu.launch(1)
        with span("optimizer"):
            gpu.launch(3)
        assert recorder.records == []  # nothing is read inside the step
    (optimizer,) = [r for r in recorder.records if r[0] == "optimizer"]
    (step,) = [r for r in recorder.records if r[0] == "step"]
    assert optimizer[2] - optimizer[1] == pytest.approx(3 * MS, rel=1e-2)
    assert step[1] <= optimizer[1] < optimizer[2] <= step[2]
    assert step[2] - step[1] == pytest.approx(4 * MS, rel=1e-2)
    assert gpu.syncs == 2  # one at the start (the anchor), one after the step


def test_marks_are_only_read_after_finish():
    clock = FakeGpu().clock()
    with pytest.raises(RuntimeError, match="begin"):
        clock.mark()
    clock.begin()
    mark = clock.mark()
    with pytest.raises(RuntimeError, match="finish"):
        clock.resolve(mark)
    clock.finish()
    assert isinstance(clock.resolve(mark), int)


def test_clock_for_picks_by_device_type():
    assert isinstance(clock_for("cpu"), HostClock) and isinstance(clock_for(None), HostClock)
    assert isinstance(clock_for("cuda:0"), CudaClock)  # constructing it touches no GPU
