"""Tensor-parallel weights split by strided rows (fused q, k, v) in a checkpoint: saved whole, loaded and re-split.

DCP stores each rank's piece of a DTensor as one box of the global tensor; a `strided_shard` piece (rows r of
q, of k and of v) is not one box, and DCP refuses it ("overlapping chunks"). Such values are written as their
full tensor (every TP peer writes the same one; DCP keeps one copy) and read into a full tensor that is then
split again locally (`distribute_tensor(..., src_data_rank=None)`: no communication). The keys and the stored
shape are those of the unsplit model, so the checkpoint stays layout-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pipetrain.compat.dtensor import is_strided

__all__ = ["gather_strided", "full_targets"]


def gather_strided(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with every strided DTensor replaced by its full tensor (a collective on its mesh)."""
    return {key: value.full_tensor() if is_strided(value) else value for key, value in state.items()}


def full_targets(state: dict[str, Any]) -> tuple[dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]]]:
    """(`state` with a full-size buffer for each strided DTensor, the function that splits the loaded buffers
    back into DTensors of the original placements)."""
    strided: dict[str, DTensor] = {key: value for key, value in state.items() if is_strided(value)}
    targets = dict(state)
    for key, value in strided.items():
        targets[key] = torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)

    def split(loaded: dict[str, Any]) -> dict[str, Any]:
        out = dict(loaded)
        for key, value in strided.items():
            out[key] = distribute_tensor(loaded[key], value.device_mesh, value.placements, src_data_rank=None)
        return out

    return targets, split
