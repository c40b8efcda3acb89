"""Live bytes: a dispatch mode (torch's private `TorchDispatchMode`) that counts each storage an operator creates
until it is freed, and their peak: what a CPU run allocates, where no allocator keeps statistics.

A storage is followed by a weak reference (a storage's Python object lives as long as its C++ storage, held by
autograd or anything else), so tensors saved for backward count until the backward frees them. DTensors are not
counted themselves (their local tensors are, as their operators run below the mode)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as live:` ... `live.bytes` (now), `live.peak` (the most at once; `reset()` restarts it)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size and key not in self.live:
                self.live[key] = size
                self.bytes += size
                self.peak = max(self.peak, self.bytes)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.bytes -= self.live.pop(key, 0)

    def reset(self) -> None:
        """Start a new peak from what is live now (after a garbage collection)."""
        gc.collect()
        self.peak = self.bytes
