"""Live bytes: a dispatch mode (torch's private `TorchDispatchMode`) that counts each storage an operator creates
until it is freed, and their peak: what a CPU run allocates, where no allocator keeps statistics.

A storage is followed by its Python object (one per C++ storage, alive as long as it is: held by autograd or
anything else), so tensors saved for backward count until the backward frees them. DTensors are not counted
themselves (their local tensors are, as their operators run below the mode). A storage resized in place
(`untyped_storage().resize_`, which no operator dispatch sees) counts at its new size: FSDP2 frees a block's
gathered weights by resizing their storages to 0 and gathers them again into the same storages, resized back
(torch 2.13 `_fsdp_param.py`: `free_storage`, `alloc_storage`); a storage first met so resized is followed from
then on. Storages alive before (`existing`, e.g. `live_storages()`) are not counted again when an operator returns
a view of them (a linear layer's transposed weight, a gradient in DDP's bucket, a pipeline's receive buffer): they
are `held`, and count from then on only as they are resized or die."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "live_storages"]

#: the counters installed now (innermost last), told of every storage resized while any is
_ACTIVE: list[LiveBytes] = []
_RESIZE = torch.UntypedStorage.resize_


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    out = _RESIZE(storage, size)
    for counter in _ACTIVE:
        counter.resized(storage)
    return out


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as live:` ... `live.bytes` (now), `live.peak` (the most at once; `reset()` restarts it),
    both beyond `live.held` (the `existing` storages' bytes at the start)."""

    def __init__(self, existing: Iterable[torch.UntypedStorage] = ()) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # id of a storage's Python object -> its bytes
        self.bytes = self.peak = 0  # beyond `held`, the bytes of the existing storages at the start
        self.held = 0
        for storage in existing:
            if id(storage) not in self.live:
                self.live[id(storage)] = storage.nbytes()
                self.held += storage.nbytes()
                weakref.finalize(storage, self._free, id(storage))

    def __enter__(self) -> LiveBytes:
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign]
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _RESIZE  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter:
                continue
            storage = tensor.untyped_storage()
            if id(storage) not in self.live:
                self._follow(storage)
        return out

    def _follow(self, storage: torch.UntypedStorage) -> None:
        size = storage.nbytes()
        if not size:
            return
        key = id(storage)
        self.live[key] = size
        self._add(size)
        weakref.finalize(storage, self._free, key)

    def _add(self, size: int) -> None:
        self.bytes += size
        self.peak = max(self.peak, self.bytes)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Count `storage` at its size now (called after it was resized in place)."""
        key = id(storage)
        if key not in self.live:
            self._follow(storage)
            return
        size = storage.nbytes()
        self._add(size - self.live[key])
        self.live[key] = size

    def _free(self, key: int) -> None:
        self.bytes -= self.live.pop(key, 0)

    def reset(self) -> None:
        """Start a new peak from what is live now (after a garbage collection)."""
        gc.collect()
        self.peak = self.bytes


def live_storages() -> list[torch.UntypedStorage]:
    """The storages of every plain tensor the garbage collector knows (after a collection; DTensors through their
    local tensors, meta tensors left out): what `LiveBytes(existing=...)` takes as held at its start."""
    gc.collect()
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if (type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            found.setdefault(id(storage), storage)
    return list(found.values())
