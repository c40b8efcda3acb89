"""The one clock pipetrain times work with: the host's `perf_counter` on the CPU, the device's on CUDA.

CUDA kernels and NCCL sends, receives and all-reduces return when queued (pytorch/pytorch#129341): host time
around them measures launches, not work. So on CUDA

- `seconds(fn)` (the calibration's timings) synchronises the device before and after `fn`;
- `mark()` (the trace's spans) records a CUDA event on the current stream; marks are turned into host-clock
  nanoseconds by `resolve` once `finish()` has synchronised, i.e. after the recorded step, not inside it.
  A window opened by `begin()` anchors the events to the host clock (a synchronise, then the host time
  and an event together).

`clock_for(device)` picks the clock; `CudaClock` takes its event class and synchronise function as
arguments, so a fake device tests it on a machine without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Clock", "HostClock", "CudaClock", "clock_for"]


class Clock(Protocol):
    """What a timing needs: synchronise, time a call, and marks resolved to host nanoseconds after the fact."""

    def synchronize(self) -> None: ...
    def seconds(self, fn: Callable[[], Any]) -> float: ...
    def begin(self) -> None: ...
    def mark(self) -> Any: ...
    def finish(self) -> None: ...
    def resolve(self, mark: Any) -> int: ...


class HostClock:
    """The CPU's clock: work is done when the call returns; a mark is `perf_counter_ns()` itself."""

    def synchronize(self) -> None:
        """Nothing to wait for on the CPU."""

    def seconds(self, fn: Callable[[], Any]) -> float:
        """Seconds `fn()` took."""
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def begin(self) -> None:
        """Nothing to anchor."""

    def mark(self) -> int:
        return time.perf_counter_ns()

    def finish(self) -> None:
        """Nothing pending."""

    def resolve(self, mark: int) -> int:
        return mark


class CudaClock:
    """A CUDA device's clock: events on the current stream, read after a synchronise."""

    def __init__(self, device: torch.device | None = None, *, event: Callable[..., Any] | None = None,
                 synchronize: Callable[[], None] | None = None, host_ns: Callable[[], int] = time.perf_counter_ns):
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._sync = synchronize or (lambda: torch.cuda.synchronize(device))
        self._host_ns = host_ns
        self._anchor: tuple[int, Any] | None = None
        self._finished = False

    def synchronize(self) -> None:
        """Wait until the device has done everything queued so far (every stream: NCCL's too)."""
        self._sync()

    def seconds(self, fn: Callable[[], Any]) -> float:
        """Seconds from an idle device to the end of the work `fn()` queued."""
        self._sync()
        start = self._host_ns()
        fn()
        self._sync()
        return (self._host_ns() - start) / 1e9

    def begin(self) -> None:
        """Open a window of marks: synchronise, then take the host time and an event at the same moment."""
        self._sync()
        self._anchor = (self._host_ns(), self._record())
        self._finished = False

    def mark(self) -> Any:
        """An event recorded now on the current stream (it fires when the work queued before it is done)."""
        if self._anchor is None:
            raise RuntimeError("CudaClock.mark() outside a window: call begin() first")
        return self._record()

    def finish(self) -> None:
        """Synchronise, so that every mark of the window can be resolved."""
        self._sync()
        self._finished = True

    def resolve(self, mark: Any) -> int:
        """The host-clock nanoseconds at which `mark` fired (after `finish`)."""
        if self._anchor is None or not self._finished:
            raise RuntimeError("CudaClock.resolve() before finish(): the events may not have fired yet")
        host, event = self._anchor
        return host + round(event.elapsed_time(mark) * 1e6)  # elapsed_time: milliseconds

    def _record(self) -> Any:
        event = self._event()
        event.record()
        return event


def clock_for(device: torch.device | str | None) -> HostClock | CudaClock:
    """The clock of `device`: `CudaClock` on CUDA, `HostClock` elsewhere."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return CudaClock(dev) if dev.type == "cuda" else HostClock()
