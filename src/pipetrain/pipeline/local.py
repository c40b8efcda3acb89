"""This rank's stage modules: its blocks built, split, compiled, BatchNorm-aware, recomputed and wrapped, and their
parameters and buffers named as in the unsplit model."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.batchnorm import StageNorms
from pipetrain.blocks import BlockModel, BlockSequential, build_blocks
from pipetrain.config import PipelineConfig
from pipetrain.pipeline.compiled import compile_blocks
from pipetrain.pipeline.offload import ActivationOffload
from pipetrain.pipeline.recompute import RecomputeWrapper

__all__ = ["LocalStages", "build_stages", "block_named"]


@dataclass(frozen=True)
class LocalStages:
    """One rank's stages, in `stage_ids` order: the module each schedule runs (wrapped), its recomputation wrapper
    (around the bare blocks) and its BatchNorm statistics."""

    modules: list[nn.Module]
    recompute: list[RecomputeWrapper]
    norms: list[StageNorms]


def build_stages(model: BlockModel, config: PipelineConfig, bounds: Sequence[tuple[int, int]],
                 stage_ids: Sequence[int], *, seed: int, device: torch.device,
                 split_block: Callable[[int, nn.Module], nn.Module] | None = None,
                 wrap: Callable[[nn.Module], nn.Module] | None = None) -> LocalStages:
    """Build the blocks of each of `stage_ids` (`bounds`: each stage's block range); `split_block(index, block)`
    (tensor parallelism) applies to each block as it is built, `wrap` (DDP, FSDP) to each stage's wrapper."""
    modules: list[nn.Module] = []
    recompute: list[RecomputeWrapper] = []
    norms_of: list[StageNorms] = []
    for stage_id in stage_ids:
        start, stop = bounds[stage_id]
        blocks = build_blocks(model, range(start, stop), seed=seed, device=device)
        if split_block is not None:
            blocks = [split_block(start + i, block) for i, block in enumerate(blocks)]
        if config.compile:
            compile_blocks(blocks, dynamic=config.compile_dynamic)
        stage = BlockSequential(*blocks)
        norms = StageNorms(stage, deferred=config.deferred_batchnorm)
        wrapper = RecomputeWrapper(stage, config.checkpoint, recompute_context=norms.recomputing,
                                   unit=config.recompute_unit, every=config.recompute_every, first_block=start,
                                   head=stop == model.num_blocks,
                                   offload=ActivationOffload(device) if config.offload_activations else None,
                                   matmuls=config.selective_matmuls)
        norms_of.append(norms)
        recompute.append(wrapper)
        modules.append(wrap(wrapper) if wrap else wrapper)
    return LocalStages(modules, recompute, norms_of)


def block_named(wrappers: Sequence[RecomputeWrapper], stage_ids: Sequence[int], bounds: Sequence[tuple[int, int]],
                buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters (the buffers with `buffers`) of the stages' blocks named `<block index>.<name in block>`, as in
    the unsplit `nn.Sequential`."""
    for stage_id, wrapper in zip(stage_ids, wrappers):
        first_block = bounds[stage_id][0]
        named = wrapper.module.named_buffers() if buffers else wrapper.module.named_parameters()
        for name, tensor in named:
            index, _, rest = name.partition(".")
            yield f"{first_block + int(index)}.{rest}", tensor
