"""Tied weights across stages: one tensor of the unsplit model held as a copy by each block that uses it.

A model declares its ties with the optional `BlockModel` hook `tied_parameters()`: groups of (block index,
name in block), e.g. `[((0, "embed_tokens.weight"), (31, "lm_head.weight"))]` for an input embedding tied to
the output head. The first member of a group is its *canonical* copy (its key is the one a checkpoint
stores). Each copy is an ordinary parameter of its stage; the copies stay equal because they start equal
(the canonical value is broadcast at build time) and every step's gradients are summed over the copies
before the optimizer sees them (what DeepSpeed's `TiedLayerSpec` and Megatron's embedding group do). Copies
on other pipeline ranks are summed over a small process group per tie and pipeline replica (the pp ranks
holding a copy, e.g. the first and the last); copies on one rank are summed locally. FSDP2 shards of a copy
are summed shard by shard: every copy has the same shape and is sharded alike over the same dp mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipetrain.errors import ConfigError

__all__ = ["TieGroup", "TiedWeights", "model_ties", "tied_aliases"]

#: a tie as layout-free names `<block>.<name in block>`, the canonical one first
TieGroup = tuple[str, ...]


def model_ties(model: object, num_blocks: int) -> list[TieGroup]:
    """The model's ties (`tied_parameters()`, optional) as layout-free names; [] when it declares none."""
    hook = getattr(model, "tied_parameters", None)
    groups: list[TieGroup] = []
    for group in (hook() if hook is not None else ()):
        names = tuple(f"{block}.{name}" for block, name in group)
        if len(names) < 2 or any(not 0 <= block < num_blocks for block, _ in group):
            raise ConfigError(f"tied_parameters() names {list(group)!r}: a tie needs two or more (block, name) pairs "
                              f"of blocks 0..{num_blocks - 1}", hint="fix the model's tied_parameters()")
        groups.append(names)
    return groups


def tied_aliases(model: object, num_blocks: int) -> dict[str, str]:
    """Each non-canonical tied name -> its canonical name (what a checkpoint stores instead)."""
    return {alias: group[0] for group in model_ties(model, num_blocks) for alias in group[1:]}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _Tie:
    names: TieGroup
    local: list[nn.Parameter]  # this rank's copies, in the group's order
    canonical_here: bool  # whether this rank holds the canonical copy
    group: dist.ProcessGroup | None  # the pp ranks of this replica holding a copy (None: all on this rank)
    owner: int  # global rank holding the canonical copy


class TiedWeights:
    """The ties of one engine's stages: keeps their copies equal (`sync_values`, `reduce_grads`)."""

    def __init__(self, ties: Sequence[TieGroup], named: dict[str, nn.Parameter], rank_of_block: Sequence[int],
                 pp_group: dist.ProcessGroup | None) -> None:
        self._ties: list[_Tie] = []
        if not ties:
            return
        pipelines = _all_pipelines(pp_group)  # every replica's pp ranks (global ranks, in pp order)
        mine = _pipeline_ranks(pp_group)
        for names in ties:
            pp_ranks = sorted({rank_of_block[int(name.partition(".")[0])] for name in names})
            group = None
            for pipeline in pipelines:  # every rank creates every group, in the same order
                if len(pp_ranks) > 1:
                    created = dist.new_group([pipeline[r] for r in pp_ranks])
                    if pipeline == mine:
                        group = created
            local = [named[name] for name in names if name in named]
            owner = mine[rank_of_block[int(names[0].partition(".")[0])]]
            if local:
                self._ties.append(_Tie(names, local, names[0] in named, group, owner))

    def __bool__(self) -> bool:
        return bool(self._ties)

    def copies(self) -> set[int]:
        """ids of this rank's non-canonical copies (a global norm counts each tied weight once, canonically)."""
        return {id(p) for tie in self._ties for p in (tie.local[1:] if tie.canonical_here else tie.local)}

    def tied_to(self) -> dict[int, str]:
        """id of each local copy -> the canonical name of its tie."""
        return {id(p): tie.names[0] for tie in self._ties for p in tie.local}

    def embedding_ids(self, model: object) -> set[int]:
        """ids of the local copies whose canonical copy is an `nn.Embedding` table (sorted as one by the
        recipe's parameter groups, so that every copy gets the same weight decay)."""
        ids = set()
        for tie in self._ties:
            block, _, name = tie.names[0].partition(".")
            with torch.device("meta"):
                owner = model.build_block(int(block)).get_submodule(name.rpartition(".")[0])  # type: ignore[attr-defined]
            if isinstance(owner, nn.Embedding):
                ids.update(id(p) for p in tie.local)
        return ids

    @torch.no_grad()
    def sync_values(self) -> None:
        """Make every copy equal to the canonical one (after building, after loading); collective over ties."""
        for tie in self._ties:
            first = _local(tie.local[0].data)
            if tie.group is not None:
                dist.broadcast(first, src=tie.owner, group=tie.group)
            for other in tie.local[1:]:
                _local(other.data).copy_(first)

    def take_grads(self) -> list[list[torch.Tensor | None]]:
        """Set aside the copies' gradients accumulated before a step (`reduce_grads` adds them back)."""
        kept = []
        for tie in self._ties:
            kept.append([p.grad for p in tie.local])
            for p in tie.local:
                p.grad = None
        return kept

    @torch.no_grad()
    def reduce_grads(self, kept: Iterable[list[torch.Tensor | None]] | None = None) -> None:
        """Sum this step's gradients over every copy of each tie, then add back what `take_grads` set aside.
        A collective call over each tie's group: every rank holding a copy calls it after the backward."""
        kept = list(kept) if kept is not None else [[None] * len(t.local) for t in self._ties]
        for tie, before in zip(self._ties, kept):
            if not tie.local[0].requires_grad:  # frozen on every rank (LoRA's base): no gradient to sum
                continue
            grads = [p.grad for p in tie.local]
            template = next((g for g in grads if g is not None), None)
            if template is None:
                template = torch.zeros_like(tie.local[0])
            total = torch.zeros_like(_local(template))
            for grad in grads:
                if grad is not None:
                    total += _local(grad)
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for param, grad, old in zip(tie.local, grads, before):
                if grad is None:
                    grad = torch.zeros_like(param)
                    param.grad = grad
                _local(grad).copy_(total)
                if old is not None:
                    param.grad = param.grad + old


def _all_pipelines(pp_group: dist.ProcessGroup | None) -> list[list[int]]:
    """The global ranks of every pipeline replica of the job (one all-gather over the world)."""
    mine = _pipeline_ranks(pp_group)
    if not dist.is_initialized():
        return [mine]
    gathered: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    unique: list[list[int]] = []
    for ranks in gathered:
        if ranks is not None and ranks not in unique:
            unique.append(ranks)
    return unique


def _pipeline_ranks(pp_group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of this rank's pipeline, in pp order."""
    if not dist.is_initialized():
        return [0]
    group = pp_group if pp_group is not None else dist.group.WORLD
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
