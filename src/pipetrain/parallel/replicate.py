"""Data parallelism over the mesh's `dp` axis: DDP replicas or FSDP2 shards of each stage module."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from pipetrain.parallel.mesh import Mesh
from pipetrain.parallel.quiet_ddp import QuietDistributedDataParallel
from pipetrain.compat.dtensor import is_strided
from pipetrain.pipeline.precision import AutocastStage, compute_dtype
from pipetrain.pipeline.recompute import RecomputeWrapper

__all__ = ["data_parallel_wrapper"]


def _blocks(module: nn.Module) -> nn.Module:
    """The `nn.Sequential` of blocks inside a stage module's precision and recomputation wrappers."""
    while isinstance(module, (AutocastStage, RecomputeWrapper)):
        module = module.module
    return module


def _shard_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's dimension for `param`: its columns for a weight tensor parallelism split by strided rows (fused
    q, k, v: FSDP2's rows of those rows would break the DTensor's global view), else the default (rows; also
    for one split by strided columns, GPT-2's `Conv1D` c_attn)."""
    strided_rows = is_strided(param) and any(getattr(p, "dim", None) == 0 for p in param.placements)
    return Shard(1) if strided_rows else None


def data_parallel_wrapper(
    mode: str, mesh: Mesh, *, stages_per_rank: int, precision: str = "fp32"
) -> Callable[[nn.Module], nn.Module] | None:
    """The function that makes a stage module data-parallel over `mesh.dp_group` (None when dp == 1; with context
    parallelism the group spans the data and context ranks, see `Mesh`).

    `ddp`: gradients all-reduced (averaged) after the last micro-batch; DDP skips frozen parameters (LoRA's base),
    and a stage with none to train is left unwrapped. With several stages per rank the
    stages' backward passes interleave, so DDP must not assume a static graph (torch 2.13 crashes at step 2
    with default flags and gives wrong gradients with `static_graph=True`); `find_unused_parameters=True`
    makes it correct. `fsdp`: FSDP2 `fully_shard` per block and per stage (parameters, gradients and
    optimizer state sharded: the ZeRO-3 equivalent), parameters kept gathered between micro-batches.
    With a reduced `precision` (bf16), FSDP2's `MixedPrecisionPolicy` gathers parameters in bf16 (half the
    traffic and unsharded memory) and reduces gradients in fp32; the shards, hence the optimizer, stay fp32.
    The stage still runs under autocast (see `AutocastStage`), so ops autocast keeps in fp32 stay fp32.
    """
    if mesh.replicas == 1:  # no data nor context parallelism
        return None
    if mode == "ddp":
        device = mesh.device_mesh.device_type

        def ddp(module: nn.Module) -> nn.Module:
            if not any(p.requires_grad for p in module.parameters()):
                return module  # a frozen stage (LoRA's first or last): no gradient to reduce, DDP refuses it
            return QuietDistributedDataParallel(
                module,
                device_ids=None if device == "cpu" else [next(module.parameters()).device],
                process_group=mesh.dp_group,
                find_unused_parameters=stages_per_rank > 1,
            )

        return ddp

    low = compute_dtype(precision)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None,
                                  cast_forward_inputs=True, output_dtype=torch.float32 if low else None)

    def fsdp(module: nn.Module) -> nn.Module:
        for block in _blocks(module).children():
            fully_shard(block, mesh=mesh.dp_mesh, reshard_after_forward=False, mp_policy=policy,
                        shard_placement_fn=_shard_placement)
        return fully_shard(module, mesh=mesh.dp_mesh, reshard_after_forward=False, mp_policy=policy,
                           shard_placement_fn=_shard_placement)

    return fsdp

