"""Data parallelism over the mesh's `dp` axis: DDP replicas, or FSDP2 shards (HSDP: replicas of shard groups)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from pipetrain.compat.modules import ddp_ignore
from pipetrain.parallel.experts import ExpertGroups, is_expert, mark_expert
from pipetrain.parallel.mesh import Mesh
from pipetrain.parallel.quiet_ddp import QuietDistributedDataParallel
from pipetrain.compat.dtensor import is_strided
from pipetrain.pipeline.precision import AutocastStage, compute_dtype
from pipetrain.pipeline.recompute import RecomputeWrapper
from pipetrain.plan.reshard import reshard_after_forward

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


def _expert_modules(module: nn.Module) -> list[nn.Module]:
    """The submodules of `module` that directly hold expert parameters (`parallel.experts.mark_expert`)."""
    return [m for m in module.modules() if any(is_expert(p) for p in m.parameters(recurse=False))]


def _reduce_each_microbatch(stage: FSDPModule) -> None:
    """Make every backward of `stage` reduce-scatter its gradients block by block and reshard its weights.

    torch's pipeline stages (2.13) set `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`
    before each micro-batch's backward, so gradients accumulate unsharded and weights stay gathered until the step's
    last backward. A hook on the stage's outputs, run when the backward reaches them (after torch set its flags,
    before any block's gradients are reduced), turns both back on: the gradients accumulate in the fp32 shards."""

    def turn_on(_grad: torch.Tensor) -> None:
        stage.set_requires_gradient_sync(True)
        stage.set_reshard_after_backward(True)

    def after_forward(_module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for tensor in output if isinstance(output, tuple) else (output,):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(turn_on)

    stage.register_forward_hook(after_forward)


def data_parallel_wrapper(
    mode: str, mesh: Mesh, *, stages_per_rank: int, precision: str = "fp32", reshard: str | int = "never",
    split_backward: bool = False, experts: ExpertGroups | None = None,
) -> Callable[[nn.Module], nn.Module] | None:
    """The function that makes a stage module data-parallel over `mesh.dp_group` (None when dp == 1; with context
    parallelism the group spans the data and context ranks, see `Mesh`).

    `ddp`: gradients all-reduced (averaged) after the last micro-batch; DDP skips frozen parameters (LoRA's base),
    and a stage with none to train is left unwrapped. With several stages per rank the
    stages' backward passes interleave, so DDP must not assume a static graph (torch 2.13 crashes at step 2
    with default flags and gives wrong gradients with `static_graph=True`); `find_unused_parameters=True`
    makes it correct. `fsdp`: FSDP2 `fully_shard` per block and per stage (parameters, gradients and
    optimizer state sharded: the ZeRO-3 equivalent); `hsdp`: the same on the 2-D (replicate, shard) mesh, sharded
    within each group of `mesh.dp_shard` ranks, gradients all-reduced across the groups.
    `reshard` (`--fsdp-reshard`, see `plan.reshard`): "never" keeps a stage's weights gathered from its forward to
    its backward; "always" (or a group size N, FSDP2's int form) frees them after each block's forward, and then
    each micro-batch's gradients are reduce-scattered at once and accumulated sharded (`ParallelConfig` refuses it
    under the schedules that split a backward in two, `split_backward`, where "auto" is never).
    With a reduced `precision` (bf16), FSDP2's `MixedPrecisionPolicy` gathers parameters in bf16 (half the
    traffic and unsharded memory) and reduces gradients in fp32; the shards, hence the optimizer, stay fp32.
    The stage still runs under autocast (see `AutocastStage`), so ops autocast keeps in fp32 stay fp32.

    With expert parallelism (`experts`), the expert parameters are not the dp group's: DDP ignores them (the engine
    reduces them over their expert-data-parallel group, `parallel.experts.ExpertGradients`); FSDP2 shards each
    experts module over the expert-data-parallel mesh first (under HSDP its 2-D one: sharded over dp_shard / ep
    ranks, replicated across the shard groups), its gradients summed there and divided by dp.
    """
    if mesh.replicas == 1:  # no data nor context parallelism
        return None
    if mode == "ddp":
        device = mesh.device_mesh.device_type

        def ddp(module: nn.Module) -> nn.Module:
            if not any(p.requires_grad and not is_expert(p) for p in module.parameters()):
                return module  # a frozen stage (LoRA's first or last): no gradient to reduce, DDP refuses it
            ddp_ignore(module, [name for name, p in module.named_parameters() if is_expert(p)])
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
    after_forward = reshard_after_forward(reshard, pp=mesh.pp, split_backward=split_backward)
    shard_mesh = mesh.shard_mesh

    def fsdp(module: nn.Module) -> nn.Module:
        if experts is not None:
            for holder in _expert_modules(module):
                fully_shard(holder, mesh=experts.edp_mesh, reshard_after_forward=False, mp_policy=policy)
                holder.set_gradient_divide_factor(float(experts.dp))
                if dist.get_backend(experts.edp_group) == "gloo" and experts.edp_mesh.shape[-1] > 1:
                    # gloo has no PREMUL_SUM: sum, then divide. A shard group of one rank (HSDP's replicas of one):
                    # FSDP2 divides while copying and all-reduces with SUM (forcing the sum would divide twice)
                    holder.set_force_sum_reduction_for_comms(True)
                for param in holder.parameters(recurse=False):  # FSDP2's new DTensor parameters: marked again
                    mark_expert(param)
        for block in _blocks(module).children():
            fully_shard(block, mesh=shard_mesh, reshard_after_forward=after_forward, mp_policy=policy,
                        shard_placement_fn=_shard_placement)
        # the root's own parameters (none: every one is in a block) need no resharding; its forward ends the stage's
        stage = fully_shard(module, mesh=shard_mesh, reshard_after_forward=after_forward, mp_policy=policy,
                            shard_placement_fn=_shard_placement)
        if after_forward:
            _reduce_each_microbatch(stage)
        return stage

    return fsdp
