"""A model's MoE layers split over the expert-parallel ranks: which blocks hold experts, the check before any rank
starts, and the function the engine applies to each block it builds.

A block's experts are the transformers fused experts modules in it (`moe.experts.is_fused_experts`: `mlp.experts` of
Qwen3-MoE, OLMoE, Qwen2-MoE, DeepSeek-V3, GPT-OSS (with biases); `mlp.experts` or `block_sparse_moe.experts` of
Mixtral). Each is replaced
by an `ExpertParallelExperts` holding this rank's slice, its parameters marked as experts' (`parallel.experts`);
PEFT's LoRA adapters of its parameters keep the same experts (`moe.adapters`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.blocks import BlockModel
from pipetrain.errors import ConfigError
from pipetrain.moe.adapters import adapter_wrappers, split_adapters
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


def _check_adapters(ep: int, dp_mode: str, name: str, experts: nn.Module) -> None:
    """The `ConfigError` of LoRA adapters on the experts module `name` split over `ep` ranks where they cannot be:
    under FSDP2 (`dp_mode`), or one transposed expert a rank (PEFT adapts a lone expert as a 2-D [out, in] weight,
    which a transposed [in, out] expert would take the wrong way round)."""
    owner = name.partition(".base_layer")[0]
    if dp_mode != "ddp":
        raise ConfigError(f"--ep {ep} --dp-mode {dp_mode} with LoRA adapters on the experts ({owner}): FSDP2 does not "
                          "gather the adapters of split experts (PEFT reads them without calling their modules)",
                          hint="pass --dp-mode ddp, or drop experts.* from --lora-targets")
    if getattr(experts, "is_transposed", False) and experts.gate_up_proj.shape[0] == ep:
        raise ConfigError(f"--ep {ep} leaves one expert a rank, and PEFT adapts a lone transposed expert "
                          f"({type(experts).__name__}, {owner}) the wrong way round",
                          hint="pass a smaller --ep, or drop experts.* from --lora-targets")


def check_expert_parallel(model: BlockModel, ep: int, *, dp_mode: str = "ddp") -> None:
    """Raise the one `ConfigError` `--ep ep` meets on `model`: no experts to split (a dense model), experts of
    another layout (no gate, a post-expert norm), `ep` not dividing a layer's experts, or LoRA adapters on the
    experts (split with them: `moe.adapters`) where they cannot be split (`_check_adapters`: under FSDP2, `dp_mode`
    other than "ddp"; one transposed expert a rank).
    No-op at ep == 1; needs no process group (the blocks are built on the meta device): the CLI calls it before it
    starts ranks."""
    if ep == 1:
        return
    named = [(name, module) for block in meta_blocks(model) for name, module in experts_in(block)]
    for name, module in named:  # PEFT wraps a targeted parameter's module: `experts.base_layer`
        if name.endswith(".base_layer"):
            _check_adapters(ep, dp_mode, name, module)
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
    `group` (the stage's expert-parallel group), PEFT's adapters of its parameters too; `grouped` and
    `backward_group` as `ExpertParallelExperts` takes them. `before`: a split applied first (tensor parallelism's,
    which keeps the MoE block whole); its `sequence_shards` is the engine's. `dp_mode`: how the stage is replicated
    (FSDP2 refuses adapters on the experts, as `check_expert_parallel`)."""

    group: dist.ProcessGroup
    grouped: bool | None = None
    backward_group: dist.ProcessGroup | None = None
    before: Callable[[int, nn.Module], nn.Module] | None = None
    dp_mode: str = "ddp"

    @property
    def sequence_shards(self) -> int:
        return getattr(self.before, "sequence_shards", 1)

    def __call__(self, index: int, block: nn.Module) -> nn.Module:
        if self.before is not None:
            block = self.before(index, block)
        for name, module in list(experts_in(block)):
            wrappers = adapter_wrappers(block, name)
            if wrappers:
                _check_adapters(dist.get_world_size(self.group), self.dp_mode, name, module)
            split = ExpertParallelExperts(module, self.group, grouped=self.grouped, backward_group=self.backward_group)
            for param in split.parameters():
                mark_expert(param)
            for wrapper in wrappers:  # PEFT's adapters of these experts: the same slice
                split_adapters(wrapper, split.first_expert, split.local_experts)
            owner, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(owner) if owner else block, leaf, split)
        return block


def expert_parallel_blocks(group: dist.ProcessGroup, *, grouped: bool | None = None,
                           model: BlockModel | None = None,
                           backward_group: dist.ProcessGroup | None = None,
                           before: Callable[[int, nn.Module], nn.Module] | None = None,
                           dp_mode: str = "ddp") -> ExpertSplit:
    """The function the engine applies to each block it builds: `before` (tensor parallelism's split), then its
    experts split over `group` (the backward's exchanges over `backward_group`, when given; `dp_mode` as
    `ExpertSplit` takes it). `model`, when it can (`keep_experts(rank, ep)`: a transformers folder), then reads only
    this rank's experts from disk."""
    keep = getattr(model, "keep_experts", None)
    if keep is not None:
        keep(dist.get_rank(group), dist.get_world_size(group))
    return ExpertSplit(group, grouped, backward_group, before, dp_mode)
