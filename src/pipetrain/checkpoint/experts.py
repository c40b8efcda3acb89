"""Expert-parallel slices in a checkpoint: each rank's slice of a MoE layer's experts written as its rows of the
whole tensor, so that a checkpoint written under one `--ep` loads under another.

Under `--ep N` a rank holds experts [r·E/N, (r+1)·E/N) of each layer under the unsplit model's key. Before DCP
saves or loads, each such tensor (parameter, and optimizer state of its shape) becomes a DTensor of the stage's
1-D expert-parallel mesh, sharded on its first dimension, of the whole tensor's shape: DCP writes each slice as its
box of the whole tensor (ranks of other expert-parallel groups write the same boxes; DCP keeps one) and reads any
layout's boxes into it. After a load the DTensors are plain slices again (`local_experts`; no copy: a DTensor made by
`from_local` shares its slice's storage). A slice that is not one box of the whole tensor (a LoRA B of fused experts,
[out, rank x E] with the expert innermost: `parallel.experts.mark_expert`'s `parts`) is a strided DTensor, which
`checkpoint.strided` writes whole and splits again after a load.

Under FSDP2 (`--dp-mode fsdp`) a rank's slice is itself sharded over the expert-data-parallel ranks (a DTensor of the
EDP mesh): before a save it is gathered into the slice (`full_tensor`, one tensor at a time) and written as above;
after a load each EDP rank keeps its shard of the slice again (`fsdp_shards`: the placements the state had, from the
same slice on every EDP rank, no communication).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pipetrain.compat.dtensor import strided_shard
from pipetrain.parallel.experts import expert_layout, is_expert

__all__ = ["ExpertSlice", "expert_slices", "shard_experts", "local_experts", "fsdp_layouts", "fsdp_shards"]


@dataclass(frozen=True)
class ExpertSlice:
    """How a rank's slice of `shape` sits in the whole tensor (`parallel.experts.mark_expert`'s `dim` and `parts`)."""

    shape: torch.Size
    dim: int = 0
    parts: int = 1


def expert_slices(container: nn.Module, clean: Callable[[str], str]) -> dict[str, ExpertSlice]:
    """Container key (wrappers' prefixes removed by `clean`) -> its slice, for every expert parameter of `container`
    (`parallel.experts.is_expert`: an `ExpertParallelExperts`' weights and biases, the LoRA adapters of them)."""
    return {clean(name): ExpertSlice(param.shape, *expert_layout(param))
            for name, param in container.named_parameters() if is_expert(param)}


def _whole(local: torch.Tensor, piece: ExpertSlice, mesh: DeviceMesh) -> DTensor:
    shape = list(local.shape)
    shape[piece.dim] *= mesh.size()
    shape = torch.Size(shape)
    placement = Shard(piece.dim) if piece.parts == 1 else strided_shard(piece.parts, piece.dim)
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _experts_of(key: str, slices: dict[str, ExpertSlice], clean: Callable[[str], str],
                optimizer: bool) -> ExpertSlice | None:
    """The slice `key` holds (None: not an expert slice)."""
    name = key.partition(".")[2].rpartition(".")[0] if optimizer and key.startswith("state.") else key
    return slices.get(clean(name))


def shard_experts(state: dict[str, Any], slices: dict[str, ExpertSlice], mesh: DeviceMesh,
                  clean: Callable[[str], str], *, optimizer: bool = False) -> dict[str, Any]:
    """`state` (a model state dict, or with `optimizer` a flattened optimizer one: `state.<key>.<what>`) with every
    expert slice (`slices`, keyed as `expert_slices` keys them; `clean` the same) a shard of the whole tensor on the
    expert-parallel `mesh`."""
    out = {}
    for key, value in state.items():
        piece = _experts_of(key, slices, clean, optimizer)
        if piece is not None and isinstance(value, torch.Tensor) and value.shape == piece.shape and (
                not isinstance(value, DTensor) or value.device_mesh is not mesh):
            local = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2's shard: the whole slice
            value = _whole(local, piece, mesh)
        out[key] = value
    return out


def local_experts(state: dict[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
    """`state` with every DTensor of the expert-parallel `mesh` back to its local slice."""
    return {key: value.to_local() if isinstance(value, DTensor) and value.device_mesh is mesh else value
            for key, value in state.items()}


def fsdp_layouts(state: dict[str, Any], slices: dict[str, ExpertSlice], mesh: DeviceMesh, clean: Callable[[str], str], *,
                 optimizer: bool = False) -> dict[str, tuple[DeviceMesh, tuple]]:
    """Key -> (mesh, placements) of every expert slice of `state` (as `shard_experts` takes them) that FSDP2 shards (a
    DTensor on another mesh than the expert-parallel `mesh`), taken before `shard_experts` replaces them."""
    return {key: (value.device_mesh, tuple(value.placements)) for key, value in state.items()
            if isinstance(value, DTensor) and value.device_mesh is not mesh
            and _experts_of(key, slices, clean, optimizer) is not None}


def fsdp_shards(state: dict[str, Any], layouts: dict[str, tuple[DeviceMesh, tuple]]) -> dict[str, Any]:
    """`state` (after `local_experts`) with each whole slice of `layouts`' keys back to its FSDP2 shard: every rank of
    the shard mesh holds the same slice, so each keeps its part without communication."""
    out = dict(state)
    for key, (shard_mesh, placements) in layouts.items():
        value = out.get(key)
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            out[key] = distribute_tensor(value, shard_mesh, list(placements), src_data_rank=None)
    return out
