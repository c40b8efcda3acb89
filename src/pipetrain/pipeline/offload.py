"""Activation offloading: the saved activations of micro-batches waiting for their backward go to pinned host memory
and come back, one micro-batch ahead, before it (`--offload-activations`; CUDA, a no-op on the CPU)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import ClassVar

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

__all__ = ["ActivationOffload"]


class _Saved:
    """One saved activation: its host copy, and its device copy once fetched (or prefetched)."""

    __slots__ = ("host", "device_copy", "ready")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.device_copy: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class ActivationOffload:
    """Moves a stage's saved activations to host memory during its forwards and back before its backwards.

    Every micro-batch of a step but the last (whose backward follows soonest) runs its forward under
    `torch.autograd.graph.saved_tensors_hooks`: each activation autograd saves (not parameters, nor DTensors) is
    copied to pinned host memory on a side stream and its device memory freed once the copy is done. A stage runs
    its backwards in micro-batch order under every schedule, so when the backward of micro-batch i first asks for
    one of its tensors, those of micro-batch i + 1 start coming back on the side stream, overlapped with i's
    backward. On a CPU device there is nothing to move: offloading is a no-op that says so, unless `host_copy`
    (tests only; default `HOST_COPY_ON_CPU`) runs this same path with host-to-host copies.
    """

    #: tests only: on a CPU device, run the offloading path with host-to-host copies instead of doing nothing
    HOST_COPY_ON_CPU: ClassVar[bool] = False

    def __init__(self, device: torch.device, *, host_copy: bool | None = None) -> None:
        self.device = device
        self.active = device.type == "cuda" or (self.HOST_COPY_ON_CPU if host_copy is None else host_copy)
        if not self.active:
            warnings.warn("--offload-activations does nothing on the CPU: activations already live in host memory",
                          RuntimeWarning, stacklevel=2)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._count = 1
        self._saved: dict[int, list[_Saved]] = {}
        #: bytes copied to the host in this step (what the memory benchmark reads)
        self.offloaded_bytes = 0

    def start_step(self, count: int) -> None:
        """Forget the last step's micro-batches; this step has `count`."""
        self._count = count
        self._saved.clear()
        self.offloaded_bytes = 0

    def saving(self, index: int):
        """The context the forward of micro-batch `index` runs in (nothing to do for the step's last)."""
        if not self.active or index >= self._count - 1:
            return nullcontext()
        return self._hooks(index)

    @contextmanager
    def _hooks(self, index: int) -> Iterator[None]:
        saved = self._saved.setdefault(index, [])

        def pack(tensor: torch.Tensor) -> object:
            if (isinstance(tensor, (nn.Parameter, DTensor)) or tensor.device.type != self.device.type
                    or not tensor.is_floating_point()):
                return tensor
            item = _Saved(self._to_host(tensor))
            saved.append(item)
            self.offloaded_bytes += tensor.numel() * tensor.element_size()
            return (index, item)

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            mine, item = packed  # type: ignore[misc]
            if mine in self._saved:  # this micro-batch's backward starts: bring the next one's tensors back now
                del self._saved[mine]
                for ahead in self._saved.get(mine + 1, ()):
                    self._fetch(ahead)
            if item.device_copy is None:
                self._fetch(item)
            if item.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(item.ready)
                item.device_copy.record_stream(torch.cuda.current_stream(self.device))
                item.ready = None
            return item.device_copy

        with saved_tensors_hooks(pack, unpack):
            yield

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._stream is None:  # tests: the same path, a host-to-host copy
            return tensor.detach().clone()
        host = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # its memory is reused only after the copy
        return host

    def _fetch(self, item: _Saved) -> None:
        if item.device_copy is not None:
            return
        if self._stream is None:
            item.device_copy = item.host.clone()
            return
        with torch.cuda.stream(self._stream):
            item.device_copy = item.host.to(self.device, non_blocking=True)
            item.ready = torch.cuda.Event()
            item.ready.record(self._stream)
