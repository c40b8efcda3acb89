"""The pipeline engine: builds this rank's stages and schedules, runs a training step or a forward-only pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)

from pipetrain.blocks import BlockModel, build_blocks
from pipetrain.config import PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.partition import balance_bounds, resolve_balance
from pipetrain.pipeline.plan import Run, plan_runs
from pipetrain.pipeline.recompute import RecomputeWrapper
from pipetrain.pipeline.shapes import boundary_tensors
from pipetrain.pipeline.timeline import span

__all__ = ["PipelineEngine", "StepResult", "SCHEDULE_CLASSES"]

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """Metrics of one step or evaluation, identical on every rank (reduced over the whole job).

    `loss` is the mean over what the loss counts (`count`: the samples, or the non-padding tokens of a
    token loss); `accuracy` is None unless outputs are class logits. `outputs` holds the last stage's
    merged outputs on the rank(s) that own it (None elsewhere).
    """

    loss: float
    accuracy: float | None
    samples: int
    outputs: torch.Tensor | None = None
    count: int = 0


class PipelineEngine:
    """Runs one pipeline (`config.pp` ranks of `pp_group`) over a `BlockModel`, building only local blocks.

    Every rank of the pipeline calls `step`/`evaluate` with the same batch; the first stage reads `inputs`,
    the last reads `targets`. `loss_fn` reduces by mean (like `F.cross_entropy`). `wrap` (e.g. DDP or FSDP
    over the data-parallel group) is applied to each local stage module; `dp` is the number of replicas
    whose gradients it averages, so that the loss of every micro-batch gets its exact share of the global batch.
    """

    def __init__(
        self,
        model: BlockModel,
        config: PipelineConfig,
        *,
        device: torch.device,
        pp_group: dist.ProcessGroup | None = None,
        loss_fn: LossFn = F.cross_entropy,
        seed: int = 0,
        dp: int = 1,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        metrics_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.loss_fn = loss_fn
        self.dp = dp
        self.pp_group = pp_group
        self.metrics_group = metrics_group
        group_size = dist.get_world_size(pp_group)
        if group_size != config.pp:
            raise ConfigError(
                f"pp={config.pp} but the pipeline group has {group_size} ranks",
                hint=f"launch dp * pp ranks with pp={group_size}, or pass --pp {group_size}",
            )
        self.pp_rank = dist.get_rank(pp_group)
        self.balance = resolve_balance(model, config)
        self._bounds = balance_bounds(self.balance)
        self.stage_ids = [self.pp_rank + v * config.pp for v in range(config.virtual_stages)]
        self._recompute: list[RecomputeWrapper] = []
        self.modules: list[nn.Module] = []
        for stage_id in self.stage_ids:
            start, stop = self._bounds[stage_id]
            blocks = build_blocks(model, range(start, stop), seed=seed, device=device)
            wrapper = RecomputeWrapper(nn.Sequential(*blocks), config.checkpoint)
            self._recompute.append(wrapper)
            self.modules.append(wrap(wrapper) if wrap else wrapper)
        self._schedules: dict[tuple[bool, Run], object] = {}
        self._loss_denominator = 1

    # ---- what the user's optimizer loop needs -------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return self.config.num_stages

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of this rank's stages (hand them to the optimizer)."""
        for module in self.modules:
            yield from module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters named `<block index>.<name in block>`, as in the unsplit `nn.Sequential`."""
        for stage_id, wrapper in zip(self.stage_ids, self._recompute):
            first_block = self._bounds[stage_id][0]
            for name, param in wrapper.module.named_parameters():
                index, _, rest = name.partition(".")
                yield f"{first_block + int(index)}.{rest}", param

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)

    # ---- running -------------------------------------------------------------------------------------

    def step(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None, *, global_batch_size: int | None = None
    ) -> StepResult:
        """Forward and backward of one batch; gradients are left in `parameters()` for the optimizer.

        `global_batch_size` is the batch summed over data-parallel replicas (default: this batch × dp).
        """
        self.train(True)
        return self._run(inputs, targets, train=True, global_batch_size=global_batch_size)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> StepResult:
        """Forward-only pass of one batch in eval mode; returns the loss/accuracy on every rank."""
        self.train(False)
        try:
            return self._run(inputs, targets, train=False, global_batch_size=None)
        finally:
            self.train(True)

    def _run(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        *,
        train: bool,
        global_batch_size: int | None,
    ) -> StepResult:
        reference = inputs if inputs is not None else targets
        if reference is None:
            raise ConfigError("step() got neither inputs nor targets", hint="pass the batch on every rank")
        batch_size = reference.shape[0]
        runs = plan_runs(batch_size, self.config.n_microbatches)
        self._loss_denominator = global_batch_size or batch_size * self.dp
        for wrapper in self._recompute:
            wrapper.start_step(sum(run.count for run in runs))
        inputs = inputs.to(self.device) if inputs is not None and self.has_first_stage else None
        targets = targets.to(self.device) if targets is not None else None
        outputs = []
        offset = 0
        for run in runs:
            part = slice(offset, offset + run.samples)
            offset += run.samples
            fresh = (train, run) not in self._schedules
            schedule = self._schedule(run, train)
            args = (inputs[part],) if inputs is not None else ()
            target = targets[part] if targets is not None and self.has_last_stage and train else None
            with self._grads_kept(fresh):
                out = schedule.step(*args, target=target) if train else schedule.eval(*args)
            if self.has_last_stage:
                outputs.append(out)
        merged = torch.cat(outputs) if outputs else None
        return self._metrics(merged, targets, batch_size)

    @contextmanager
    def _grads_kept(self, fresh: bool) -> Iterator[None]:
        """Keep the gradients already accumulated across the first run of a new schedule.

        torch 2.13 sets the `.grad` of FSDP modules to None when a schedule initialises its stages, even
        with static shapes (`_post_metadata_inference_cleanup`), which would drop the first run's gradients
        of a step made of two runs, or gradients the user accumulates over several steps.
        """
        kept = [(p, p.grad) for p in self.parameters() if p.grad is not None] if fresh else []
        for param, _ in kept:
            param.grad = None
        yield
        for param, grad in kept:
            param.grad = grad if param.grad is None else param.grad + grad

    def _weighted_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # mean loss of the micro-batch times its share of the global batch (times dp, which DDP/FSDP divide by)
        return self.loss_fn(output, target) * (output.shape[0] * self.dp / self._loss_denominator)

    def _metrics(self, outputs: torch.Tensor | None, targets: torch.Tensor | None, batch_size: int) -> StepResult:
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        if outputs is not None and targets is not None:
            outputs_ = outputs.detach()
            totals[0] = self.loss_fn(outputs_, targets).double() * batch_size
            totals[2] = batch_size
            if outputs_.dim() == 2 and not targets.is_floating_point():
                totals[1] = (outputs_.argmax(dim=1) == targets).sum()
                totals[3] = 1
        if dist.is_initialized():
            with span("metrics"):
                dist.all_reduce(totals, group=self.metrics_group)
        loss_sum, correct, count, classified = totals.tolist()
        count = max(count, 1.0)
        return StepResult(
            loss=loss_sum / count,
            accuracy=correct / count if classified else None,
            samples=int(count),
            outputs=outputs,
            count=int(count),
        )

    # ---- stages and schedules, one set per micro-batch shape ----------------------------------------

    def _schedule(self, run: Run, train: bool):
        key = (train, run)
        if key not in self._schedules:
            self._schedules[key] = self._build_schedule(run, train)
        return self._schedules[key]

    def _build_schedule(self, run: Run, train: bool):
        boundaries = boundary_tensors(self.model, self._bounds, run.size)
        stages = []
        for stage_id, module in zip(self.stage_ids, self.modules):
            example_in = torch.empty_like(boundaries[stage_id], device=self.device)
            example_in.requires_grad_(train and stage_id > 0 and example_in.is_floating_point())
            example_out = torch.empty_like(boundaries[stage_id + 1], device=self.device).requires_grad_(train)
            stages.append(
                PipelineStage(
                    module,
                    stage_id,
                    self.num_stages,
                    self.device,
                    input_args=example_in,
                    output_args=example_out,
                    group=self.pp_group,
                )
            )
        multi = len(stages) > 1
        if run.fallback or not train:
            cls = ScheduleLoopedBFS if multi else ScheduleGPipe
        else:
            cls = SCHEDULE_CLASSES[self.config.schedule]
        loss_fn = self._weighted_loss if train else None
        return cls(stages if multi else stages[0], n_microbatches=run.count, loss_fn=loss_fn, scale_grads=False)
