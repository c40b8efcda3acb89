"""This rank's schedule for each micro-batch shape: built from the stages' boundary shapes on its first use, cached."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.blocks import BlockModel, Tensors, as_tuple
from pipetrain.config import PipelineConfig
from pipetrain.pipeline.head import passed_on
from pipetrain.pipeline.runs import Run
from pipetrain.pipeline.shapes import ShapePass, signature
from pipetrain.pipeline.stages import ScheduleCache, build_schedule

__all__ = ["ShapeSchedules"]

#: what cuts a batch's inputs to this rank's tokens (context parallelism: `SequenceCut.inputs`)
InputCut = Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


class ShapeSchedules:
    """The schedules of this rank's stages (`modules`, stages `stage_ids` of blocks `bounds`), one per training or
    forward-only run, micro-batch count and input shape, at most `config.shape_cache` of them (`cache`). Each shape's
    stage boundaries come from the meta shape pass (`shape_pass`, memoised per input layout); `sequence_shards`:
    tensor parallelism's sequence shards between stages; `cut`: the inputs cut to this rank's tokens."""

    def __init__(self, *, model: BlockModel, config: PipelineConfig, modules: Sequence[nn.Module],
                 stage_ids: Sequence[int], bounds: Sequence[tuple[int, int]], device: torch.device,
                 group: dist.ProcessGroup | None, sequence_shards: int = 1, cut: InputCut | None = None) -> None:
        self.model, self.config, self.modules = model, config, modules
        self.stage_ids, self.bounds, self.device, self.group = stage_ids, bounds, device, group
        self.sequence_shards, self.cut = sequence_shards, cut
        self.cache = ScheduleCache(config.shape_cache)
        self.shape_pass = ShapePass(model, bounds, sequence_shards=sequence_shards)

    def get(self, run: Run, train: bool, inputs: tuple[torch.Tensor, ...] | None):
        """The schedule of this run's micro-batch shape (built, and cached, on its first use), and whether it was
        just built."""
        if inputs is None:
            example = as_tuple(self.model.example_input(run.size))
            example = self.cut(example) if self.cut is not None else example
        else:
            example = tuple(t[: run.size] for t in inputs)
        key = (train, run, signature(as_tuple(example)))
        return self.cache.get(key, lambda: self._build(run, train, example))

    def _build(self, run: Run, train: bool, example: Tensors):
        boundaries = self.shape_pass.boundaries(example, train=train)
        return build_schedule(
            modules=self.modules, stage_ids=self.stage_ids, num_stages=self.config.num_stages, boundaries=boundaries,
            device=self.device, group=self.group, schedule=self.config.schedule, run=run, train=train,
            loss_fn=passed_on if train else None, overlap=self.config.moe_overlap,
        )
