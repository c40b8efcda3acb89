"""Private names of DTensor (torch 2.13): the strided placement, and the placement methods every collective of a
redistribution runs through (wrapped, while asked, by `wrapped_placement_methods`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, placement_types
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["PLACEMENT_COLLECTIVES", "strided_shard", "is_strided", "wrapped_placement_methods"]

#: (class in torch.distributed.tensor.placement_types, method, span kind): where DTensor runs each collective.
PLACEMENT_COLLECTIVES: tuple[tuple[str, str, str], ...] = (
    ("Partial", "_reduce_value", "tp_all_reduce"),
    ("_MaskPartial", "_reduce_value", "tp_all_reduce"),
    ("Shard", "_reduce_shard_tensor", "tp_reduce_scatter"),
    ("Shard", "_to_replicate_tensor", "tp_all_gather"),
    ("_StridedShard", "_to_replicate_tensor", "tp_all_gather"),
    ("Shard", "_to_new_shard_dim", "tp_all_to_all"),
)


def strided_shard(parts: int, dim: int = 0) -> _StridedShard:
    """The placement of a tensor made of `parts` stacked blocks along `dim`, each block split over the mesh."""
    return _StridedShard(dim, split_factor=parts)


def is_strided(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor split by `strided_shard` (FSDP2 must then shard another dimension)."""
    return isinstance(tensor, DTensor) and any(isinstance(p, _StridedShard) for p in tensor.placements)


@contextmanager
def wrapped_placement_methods(wrap: Callable[[Callable[..., Any], str], Callable[..., Any]]) -> Iterator[None]:
    """Inside the block, each method of `PLACEMENT_COLLECTIVES` is `wrap(method, kind)` on its class (restored on
    exit): a hook on every collective DTensor runs."""
    with ExitStack() as stack:
        for cls_name, name, kind in PLACEMENT_COLLECTIVES:
            cls = getattr(placement_types, cls_name)
            original = cls.__dict__[name]
            setattr(cls, name, wrap(original, kind))
            stack.callback(setattr, cls, name, original)
        yield
