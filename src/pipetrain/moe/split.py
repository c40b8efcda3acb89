"""A model's MoE layers split over the expert-parallel ranks: which blocks hold experts, the check before any rank
starts, and the function the engine applies to each block it builds.

A block's experts are the transformers fused experts modules in it (`moe.experts.is_fused_experts`: `mlp.experts` of
Qwen3-MoE, OLMoE, Qwen2-MoE, DeepSeek-V3, GPT-OSS (with biases); `mlp.experts` or `block_sparse_moe.experts` of
Mixtral). Each is replaced
by an `ExpertParallelExperts` holding this rank's slice, its parameters marked as experts' (`parallel.experts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.blocks import BlockModel
from pipetrain.errors import ConfigError
from pipetrain.moe.experts import ExpertParallelExperts, is_fused_experts
from pipetrain.parallel.experts import mark_expert
from pipetrain.pipeline.shapes import meta_blocks

__all__ = ["ExpertSplit", "experts_in", "check_expert_parallel", "expert_parallel_blocks"]


def experts_in(block: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every experts module of `block`: a 3-D `gate_up_proj` (transformers' fused experts, of the
    layout this room splits or not: `is_fused_experts` says) or an `ExpertParallelExperts`."""
    for name, module in block.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        if isinstance(module, ExpertParallelExperts) or (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3):
            yield name, module


def check_expert_parallel(model: BlockModel, ep: int) -> None:
    """Raise the one `ConfigError` `--ep ep` meets on `model`: no experts to split (a dense model), experts of
    another layout (no gate, a post-expert norm), LoRA adapters on the experts, or `ep` not dividing a layer's experts.
    No-op at ep == 1; needs no process group (the blocks are built on the meta device): the CLI calls it before it
    starts ranks."""
    if ep == 1:
        return
    named = [(name, module) for block in meta_blocks(model) for name, module in experts_in(block)]
    adapted = next((name for name, _ in named if "base_layer" in name.split(".")), None)
    if adapted is not None:  # PEFT wraps a targeted parameter's module: `experts.base_layer`
        raise ConfigError(f"--ep {ep} with LoRA adapters on the experts ({adapted.partition('.base_layer')[0]}): "
                          "adapters of split experts are not built",
                          hint="adapt the attention and the router (e.g. --lora-targets q_proj,k_proj,v_proj,o_proj,"
                               "gate.weight) with --ep, or train the experts' adapters at --ep 1")
    found = [module for _, module in named]
    other = next((module for module in found if not is_fused_experts(module)), None)
    if other is not None:
        raise ConfigError(f"--ep {ep} splits transformers' fused gated experts (3-D gate_up_proj and down_proj, "
                          f"optional [E, ...] biases); the model's {type(other).__name__} has another layout",
                          hint="drop --ep (or pass --ep 1) for this model")
    counts = {module.gate_up_proj.shape[0] for module in found}
    if not counts:
        raise ConfigError(f"--ep {ep} splits the experts of MoE layers, but the model {type(model).__name__} has "
                          "none (a dense model, or experts without transformers' fused gate_up_proj/down_proj)",
                          hint="drop --ep (or pass --ep 1)")
    for total in sorted(counts):
        if total % ep:
            raise ConfigError(f"--ep {ep} does not divide the {total} experts of the model's MoE layers",
                              hint=f"pass --ep among the divisors of {total}")


@dataclass(frozen=True)
class ExpertSplit:
    """`(index, block) -> block`: each fused experts module of the block replaced by its slice on this rank of
    `group` (the stage's expert-parallel group); `grouped` and `backward_group` as `ExpertParallelExperts` takes
    them. `before`: a split applied first (tensor parallelism's, which keeps the MoE block whole); its
    `sequence_shards` is the engine's."""

    group: dist.ProcessGroup
    grouped: bool | None = None
    backward_group: dist.ProcessGroup | None = None
    before: Callable[[int, nn.Module], nn.Module] | None = None

    @property
    def sequence_shards(self) -> int:
        return getattr(self.before, "sequence_shards", 1)

    def __call__(self, index: int, block: nn.Module) -> nn.Module:
        if self.before is not None:
            block = self.before(index, block)
        for name, module in list(experts_in(block)):
            split = ExpertParallelExperts(module, self.group, grouped=self.grouped, backward_group=self.backward_group)
            for param in split.parameters():
                mark_expert(param)
            owner, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(owner) if owner else block, leaf, split)
        return block


def expert_parallel_blocks(group: dist.ProcessGroup, *, grouped: bool | None = None,
                           model: BlockModel | None = None,
                           backward_group: dist.ProcessGroup | None = None,
                           before: Callable[[int, nn.Module], nn.Module] | None = None) -> ExpertSplit:
    """The function the engine applies to each block it builds: `before` (tensor parallelism's split), then its
    experts split over `group` (the backward's exchanges over `backward_group`, when given). `model`, when it can
    (`keep_experts(rank, ep)`: a transformers folder), then reads only this rank's experts from disk."""
    keep = getattr(model, "keep_experts", None)
    if keep is not None:
        keep(dist.get_rank(group), dist.get_world_size(group))
    return ExpertSplit(group, grouped, backward_group, before)
