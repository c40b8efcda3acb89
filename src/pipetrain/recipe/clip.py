"""The global gradient norm of a pipelined, data-parallel model, and clipping by it (`torch.nn.utils.clip_grad_norm_`).

No rank holds every gradient. This rank's share is the gradients of all its stages (virtual stages too), each
parameter counted once (a parameter shared by two local stages is one tensor). FSDP2 gradients are DTensor
shards: their norm is reduced over the shards' mesh (`full_tensor()`), so every replica of the dp axis holds
the norm of the whole stage. DDP gradients are equal on every replica after DDP's all-reduce: they are not
summed again. A tied weight (see `pipetrain.pipeline.tied`) counts once: its canonical copy only. Then the
pipeline's ranks add their `norm ** p` (the largest for the inf-norm) over the pp
group. The result is the same number on every rank of the job, computed from global values only, so every
rank takes the same decision from it (clip, skip, stop). With expert parallelism, a rank holds only its slice of
each MoE layer's experts: the experts' `norm ** p` (largest for the inf-norm) is first added over the stage's
expert-parallel group (`engine.expert_group`), whose ranks hold the other slices.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipetrain.compat.modules import foreach_mul_
from pipetrain.parallel.experts import is_expert
from pipetrain.pipeline import PipelineEngine

__all__ = ["grad_norm", "clip_grad_norm_", "clip_grads_with_norm_"]


def _with_grads(engine: PipelineEngine, *, once: bool = False) -> list[torch.Tensor]:
    """This rank's parameters that have a gradient, each once (`once`: tied copies left out but the canonical)."""
    tied = getattr(engine, "tied", None)
    seen: set[int] = tied.copies() if once and tied else set()
    params = []
    for param in engine.parameters():
        if id(param) not in seen and param.grad is not None:
            seen.add(id(param))
            params.append(param)
    return params


def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of this rank's share of the gradients, DTensor shards already reduced over their mesh (float64)."""
    plain = [g for g in grads if not isinstance(g, DTensor)]
    by_mesh: dict[object, list[DTensor]] = defaultdict(list)
    for grad in grads:
        if isinstance(grad, DTensor):
            by_mesh[grad.device_mesh].append(grad)
    norms = []
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain, norm_type).double())
    for shards in by_mesh.values():  # one reduction per mesh (FSDP2: the dp mesh)
        norm = torch.nn.utils.get_total_norm(shards, norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).double())
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


@torch.no_grad()
def grad_norm(engine: PipelineEngine, norm_type: float = 2.0) -> float:
    """The `norm_type` norm of every gradient of the whole model (all stages, replicas and shards), on every
    rank; a collective call (every rank of the job calls it). nan or inf when a gradient is not finite."""
    norm_type = float(norm_type)
    params = _with_grads(engine, once=True)
    experts = getattr(engine, "expert_group", None)
    local = _local_norm([p.grad for p in params if experts is None or not is_expert(p)], norm_type).to(engine.device)
    if experts is not None and dist.get_world_size(experts) > 1:  # every rank of the group calls, experts or not
        part = _local_norm([p.grad for p in params if is_expert(p)], norm_type).to(engine.device).reshape(1)
        if math.isinf(norm_type):
            part = torch.nan_to_num(part, nan=math.inf)
            dist.all_reduce(part, op=dist.ReduceOp.MAX, group=experts)
            local = torch.maximum(local, part[0])
        else:
            part = part ** norm_type
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=experts)
            local = (local ** norm_type + part[0]) ** (1.0 / norm_type)
    group = engine.pp_group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        if math.isinf(norm_type):
            # gloo's MAX may drop a nan (it compares): send it as inf, which MAX keeps
            value = torch.nan_to_num(local.reshape(1), nan=math.inf)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            return value.item()
        value = (local ** norm_type).reshape(1)
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
        return (value ** (1.0 / norm_type)).item()
    return local.item()


@torch.no_grad()
def clip_grads_with_norm_(engine: PipelineEngine, max_norm: float, total_norm: float) -> None:
    """Scale this rank's gradients by `min(1, max_norm / (total_norm + 1e-6))`, as torch does (no-op when
    `total_norm` is not finite: such a step is skipped or stops the job)."""
    if not math.isfinite(total_norm):
        return
    coef = min(1.0, max_norm / (total_norm + 1e-6))  # torch's clamped coefficient
    if coef < 1.0:
        # each gradient's local part (a DTensor's shard or replica: scaling is linear) times the coefficient;
        # plain and DTensor gradients are mixed under tensor parallelism, which one foreach call would refuse
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in _with_grads(engine)]
        if grads:
            foreach_mul_(grads, coef)


def clip_grad_norm_(engine: PipelineEngine, max_norm: float, norm_type: float = 2.0) -> float:
    """`torch.nn.utils.clip_grad_norm_` over the whole model: the global norm (returned, the same on every
    rank), then every gradient scaled by `min(1, max_norm / (norm + 1e-6))`. A collective call."""
    total = grad_norm(engine, norm_type)
    clip_grads_with_norm_(engine, max_norm, total)
    return total
