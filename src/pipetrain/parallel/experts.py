"""Expert parallelism's groups inside each stage, and the reduction of the experts' gradients.

`--ep N` borrows ranks of each stage's data-parallel group, as torchtitan and Megatron do: the dp ranks of one
pipeline rank form dp/ep expert-parallel (EP) groups of `ep` neighbours (dp ranks d with the same d // ep), and each
EP group splits every MoE layer's experts over its ranks. The ranks holding the same experts (the same d % ep, one in
each EP group) form the expert-data-parallel (EDP) group of dp/ep ranks. Every stage has its own groups; with the
mesh's order (rank = dp_rank * pp + pp_rank) they are the axes of a (dp/ep, ep, pp) device mesh named
("edp", "ep", "pp").

An expert's gradient on a rank already sums what every token of its EP group contributed (the backward of the
combine all-to-all brings them); summed over the EDP group it covers every replica's tokens, and divided by dp it is
the average DDP gives every other parameter (the engine's loss is scaled for that division). Expert parameters are
marked (`mark_expert`) so that DDP skips them and `ExpertGradients` reduces them instead, once per step.

Under tensor parallelism (`tp` innermost: rank = (dp_rank * pp + pp_rank) * tp + tp_rank) the MoE block is whole on
every TP rank (`workloads/hf/families/moe.py`): the groups above are formed per TP rank, a fourth mesh axis.

Under HSDP (shard groups of `dp_shard` neighbouring dp ranks, `ep` dividing it) an EP group lies inside one shard
group, and the EDP axis is itself two, as torchtitan's ("dp_replicate", "efsdp"): ("edp_replicate", "edp_shard") of
dp/dp_shard × dp_shard/ep ranks, "edp" their flattened whole; FSDP2 shards the experts over the 2-D `edp_mesh`
(sharded over dp_shard/ep ranks, replicated across the shard groups).

Beside context parallelism (rank = (dp_rank * cp + cp_rank) * pp + pp_rank) each cp rank routes its own part of the
sequence: an EP group is the `ep` dp ranks with the same cp coordinate, a (dp/ep, ep, cp, pp) mesh. The ranks holding
the same experts are then the dp/ep * cp ranks of ("edp", "cp"), flattened into the EDP group, and the gradient is
divided by dp * cp, the ranks DDP and FSDP2 average every other parameter over (`ExpertGroups.dp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipetrain.compat.mesh import flatten_mesh
from pipetrain.parallel.mesh import Mesh

__all__ = ["ExpertGroups", "ExpertGradients", "build_expert_groups", "mark_expert", "is_expert", "expert_layout",
           "gather_experts"]

#: the attribute that marks a parameter held by one rank of an expert-parallel group (its slice of the experts)
EXPERT_MARK = "expert_parallel"
#: the attribute holding how a marked parameter's slice sits in the whole tensor: (dim, parts), see `mark_expert`
EXPERT_LAYOUT = "expert_layout"


def mark_expert(param: nn.Parameter, *, dim: int = 0, parts: int = 1) -> nn.Parameter:
    """Mark `param` as an expert parameter: reduced over the expert-data-parallel group, not by DDP. Its slice of
    the whole tensor: along `dim`, the whole made of `parts` stacked blocks each split over the expert-parallel
    ranks (1: the rank's rows of the experts, `gate_up_proj`; a LoRA B of fused experts, [out, rank x E] with the
    expert innermost, is `dim=1, parts=rank`)."""
    setattr(param, EXPERT_MARK, True)
    setattr(param, EXPERT_LAYOUT, (dim, parts))
    return param


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` was marked by `mark_expert`."""
    return getattr(param, EXPERT_MARK, False)


def expert_layout(param: torch.Tensor) -> tuple[int, int]:
    """(dim, parts) of a parameter marked by `mark_expert` (see there); (0, 1) when it was marked without them."""
    return getattr(param, EXPERT_LAYOUT, (0, 1))


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel group (`ep_group`, `ep` ranks; `ep_mesh` its 1-D mesh, for checkpoints) and
    expert-data-parallel group (`edp_group`, dp/ep ranks holding the same experts, times cp beside context
    parallelism; `edp_mesh` its mesh for FSDP2: 1-D, or under HSDP 2-D (replicate, shard)); `dp` the ranks an expert
    gradient is divided by (dp * cp: the ranks holding a stage's other parameters); `ep_backward_group`: a second
    group of the `ep_group`'s ranks for the backward's exchanges (with `--moe-overlap on`; else None)."""

    ep: int
    dp: int
    ep_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    edp_mesh: DeviceMesh
    ep_rank: int
    ep_mesh: DeviceMesh
    ep_backward_group: dist.ProcessGroup | None = None


def build_expert_groups(mesh: Mesh, ep: int, *, backward_group: bool = False) -> ExpertGroups:
    """The EP and EDP groups of every stage (and, under tensor parallelism, of every TP rank; beside context
    parallelism, of every cp rank) over `mesh` (`ep` divides dp), and with `backward_group` a second EP group of
    each (for `--moe-overlap on`); a collective call."""
    device = mesh.device_mesh.device_type
    shape, names = (mesh.dp // ep, ep), ("edp", "ep")
    hsdp = mesh.dp_shard > 0 and mesh.cp == 1
    if hsdp:  # the EDP axis split as the dense one: replicas of shard groups (`ep` divides `dp_shard`)
        shape, names = (mesh.dp // mesh.dp_shard, mesh.dp_shard // ep, ep), ("edp_replicate", "edp_shard", "ep")
    if mesh.cp > 1:  # each cp rank's tokens go to the experts of the EP group of its cp coordinate
        shape, names = (*shape, mesh.cp), (*names, "cp")
    shape, names = (*shape, mesh.pp), (*names, "pp")
    if mesh.tp > 1:  # the innermost axis: each TP rank's experts are split over its own EP group
        shape, names = (*shape, mesh.tp), (*names, "tp")
    experts = init_device_mesh(device, shape, mesh_dim_names=names)
    if hsdp:
        edp_mesh = experts["edp_replicate", "edp_shard"]
        edp = flatten_mesh(edp_mesh, "edp")
    else:
        edp = edp_mesh = flatten_mesh(experts["edp", "cp"], "edp_cp") if mesh.cp > 1 else experts["edp"]
    second = None
    if backward_group:  # every rank creates every group, in one order (new_group is collective over the world)
        rank = dist.get_rank()
        for ranks in experts.mesh.movedim(names.index("ep"), -1).reshape(-1, ep).tolist():
            group = dist.new_group(ranks)
            second = group if rank in ranks else second
    return ExpertGroups(ep=ep, dp=mesh.replicas, ep_group=experts.get_group("ep"), edp_group=edp.get_group(),
                        edp_mesh=edp_mesh, ep_rank=mesh.dp_rank % ep, ep_mesh=experts["ep"],
                        ep_backward_group=second)


class ExpertGradients:
    """Reduces the gradients of a rank's expert parameters after each step: summed over the EDP group, divided by
    `groups.dp` (dp * cp; None counts as zero: a rank whose experts got no token). Gradients a caller accumulates
    over steps are taken before the step (`take`) and added back after the reduction (`reduce`), as the engine does
    for tied weights, so that each step's gradients are reduced once."""

    def __init__(self, params: list[nn.Parameter], groups: ExpertGroups) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.groups = groups

    def take(self) -> list[torch.Tensor | None]:
        """The gradients held before the step (left None on the parameters)."""
        kept = [p.grad for p in self.params]
        for param in self.params:
            param.grad = None
        return kept

    def reduce(self, kept: list[torch.Tensor | None]) -> None:
        """This step's gradients summed over the EDP group and divided by `groups.dp`, plus what `take` kept."""
        if not self.params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dist.get_world_size(self.groups.edp_group) > 1:
            dist.all_reduce(flat, group=self.groups.edp_group)
        flat /= self.groups.dp
        for param, grad, before in zip(self.params, flat.split([p.numel() for p in self.params]), kept, strict=True):
            grad = grad.view_as(param)
            param.grad = grad if before is None else before + grad


def gather_experts(local: torch.Tensor, group: dist.ProcessGroup, *, dim: int = 0, parts: int = 1) -> torch.Tensor:
    """The whole tensor of a layer's experts from each rank's slice `local` (its rows, in the group's rank order;
    `dim` and `parts` as `mark_expert` takes them): a collective over the expert-parallel `group` (not
    differentiable)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    if parts == 1 and dim == 0:
        return torch.cat(pieces)
    shape = local.shape
    blocks = [piece.reshape(*shape[:dim], parts, shape[dim] // parts, *shape[dim + 1:]) for piece in pieces]
    return torch.cat(blocks, dim=dim + 1).reshape(*shape[:dim], -1, *shape[dim + 1:])
