"""Expert-parallel slices in a checkpoint: each rank's slice of a MoE layer's experts written as its rows of the
whole tensor, so that a checkpoint written under one `--ep` loads under another.

Under `--ep N` a rank holds experts [r·E/N, (r+1)·E/N) of each layer under the unsplit model's key. Before DCP
saves or loads, each such tensor (parameter, and optimizer state of its shape) becomes a DTensor of the stage's
1-D expert-parallel mesh, sharded on its first dimension, of the whole tensor's shape: DCP writes each slice as its
box of the whole tensor (ranks of other expert-parallel groups write the same boxes; DCP keeps one) and reads any
layout's boxes into it. After a load the DTensors are plain slices again (`local_experts`; no copy: a DTensor made by
`from_local` shares its slice's storage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from pipetrain.moe.experts import ExpertParallelExperts

__all__ = ["expert_slices", "shard_experts", "local_experts"]


def expert_slices(container: nn.Module, clean: Callable[[str], str]) -> dict[str, int]:
    """Container key (wrappers' prefixes removed by `clean`) -> the layer's expert count, for every parameter of an
    `ExpertParallelExperts` in `container`."""
    return {clean(f"{name}.{leaf}"): module.num_experts for name, module in container.named_modules()
            if isinstance(module, ExpertParallelExperts) for leaf in ("gate_up_proj", "down_proj")}


def _whole(local: torch.Tensor, experts: int, mesh: DeviceMesh) -> DTensor:
    shape = torch.Size((experts, *local.shape[1:]))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def shard_experts(state: dict[str, Any], slices: dict[str, int], mesh: DeviceMesh, clean: Callable[[str], str], *,
                  optimizer: bool = False) -> dict[str, Any]:
    """`state` (a model state dict, or with `optimizer` a flattened optimizer one: `state.<key>.<what>`) with every
    expert slice (`slices`, keyed as `expert_slices` keys them; `clean` the same) a shard of the whole tensor on the
    expert-parallel `mesh`."""
    out = {}
    for key, value in state.items():
        name = key.partition(".")[2].rpartition(".")[0] if optimizer and key.startswith("state.") else key
        experts = slices.get(clean(name))
        if experts is not None and isinstance(value, torch.Tensor) and value.dim() >= 1 and not isinstance(
                value, DTensor) and value.shape[0] * mesh.size() == experts:
            value = _whole(value, experts, mesh)
        out[key] = value
    return out


def local_experts(state: dict[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
    """`state` with every DTensor of the expert-parallel `mesh` back to its local slice."""
    return {key: value.to_local() if isinstance(value, DTensor) and value.device_mesh is mesh else value
            for key, value in state.items()}
