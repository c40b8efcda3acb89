"""This rank's `PipelineStage`s and schedule for one micro-batch shape, and a bounded cache of them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from pipetrain.compat.overlap import overlap_fused_actions
from pipetrain.compat.pipelining import BreadthFirstV
from pipetrain.config import V_SCHEDULES
from pipetrain.errors import ConfigError
from pipetrain.pipeline.runs import Run

__all__ = ["SCHEDULE_CLASSES", "build_schedule", "ScheduleCache", "grads_kept"]

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}


def _real(meta: tuple[torch.Tensor, ...], device: torch.device, requires_grad: bool) -> tuple[torch.Tensor, ...]:
    # float tensors keep the gradient flag shape inference found; integer/boolean ones never carry one
    return tuple(torch.empty_like(t, device=device).requires_grad_(requires_grad and t.requires_grad) for t in meta)


def build_schedule(
    *,
    modules: Sequence[nn.Module],
    stage_ids: Sequence[int],
    num_stages: int,
    boundaries: Sequence[tuple[torch.Tensor, ...]],
    device: torch.device,
    group: dist.ProcessGroup | None,
    schedule: str,
    run: Run,
    train: bool,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    overlap: bool = False,
):
    """The schedule running `run` over this rank's stages, with static shapes from `boundaries`; with `overlap`,
    DualPipeV's fused forward-and-backward actions run their two halves at once (`compat.overlap`).

    A fallback run (a remainder micro-batch) and every forward-only run use GPipe order (looped BFS with
    several stages per rank, `BreadthFirstV` under a V schedule), which any number of micro-batches allows.
    The model's outputs were checked when the engine was built (`shapes.check_model_outputs`).
    """
    stages = [
        PipelineStage(
            module, stage_id, num_stages, device,
            input_args=_real(boundaries[stage_id], device, train and stage_id > 0),
            output_args=_real(boundaries[stage_id + 1], device, train),
            group=group,
        )
        for stage_id, module in zip(stage_ids, modules)
    ]
    multi = len(stages) > 1
    if run.fallback or not train:
        if multi and schedule in V_SCHEDULES:
            return BreadthFirstV(stages, run.count, train=train, loss_fn=loss_fn, scale_grads=False)
        cls = ScheduleLoopedBFS if multi else ScheduleGPipe
    else:
        cls = SCHEDULE_CLASSES[schedule]
    built = cls(stages if multi else stages[0], n_microbatches=run.count, loss_fn=loss_fn, scale_grads=False)
    if overlap and cls is ScheduleDualPipeV:
        overlap_fused_actions(built)
    return built


class ScheduleCache:
    """At most `capacity` schedules by key (their stages hold buffers sized for one shape); the least
    recently used is dropped first, so memory stays flat however many shapes (sequence lengths) come."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ConfigError(f"the schedule cache needs room for 1 shape or more, got {capacity}",
                              hint="pass --shape-cache 1 or more")
        self.capacity = capacity
        self.evictions = 0
        self._entries: OrderedDict[Hashable, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable, build: Callable[[], object]) -> tuple[object, bool]:
        """The schedule of `key` (built by `build()` when missing) and whether it was just built."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key], False
        while len(self._entries) >= self.capacity:
            self._entries.popitem(last=False)
            self.evictions += 1
        self._entries[key] = entry = build()
        return entry, True


@contextmanager
def grads_kept(parameters: Iterable[nn.Parameter], fresh: bool) -> Iterator[None]:
    """Keep the gradients already accumulated across the first run of a new schedule (`fresh`).

    torch 2.13 sets the `.grad` of FSDP modules to None when a schedule initialises its stages, even
    with static shapes (`_post_metadata_inference_cleanup`), which would drop the first run's gradients
    of a step made of two runs, or gradients the user accumulates over several steps.
    """
    kept = [(p, p.grad) for p in parameters if p.grad is not None] if fresh else []
    for param, _ in kept:
        param.grad = None
    yield
    for param, grad in kept:
        param.grad = grad if param.grad is None else param.grad + grad
