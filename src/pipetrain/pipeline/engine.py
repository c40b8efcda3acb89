"""The pipeline engine: builds this rank's stages and schedules, runs a training step or a forward-only pass."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipetrain.batchnorm import StageNorms, share_statistics
from pipetrain.blocks import BlockModel, Tensors, as_tuple
from pipetrain.config import PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.partition import balance_bounds, resolve_balance
from pipetrain.pipeline.head import LossHead, armed
from pipetrain.pipeline.local import block_named, build_stages
from pipetrain.pipeline.loss import Loss, as_loss, vocab_parallel
from pipetrain.pipeline.metrics import (
    StepResult, add_sums, first_rows, global_count_of, merge_outputs, step_result, whole, zero_sums,
)
from pipetrain.pipeline.runs import plan_runs
from pipetrain.pipeline.recompute import RecomputeWrapper
from pipetrain.pipeline.shape_schedules import ShapeSchedules
from pipetrain.pipeline.stages import SCHEDULE_CLASSES, grads_kept
from pipetrain.pipeline.tied import TiedWeights, model_ties

__all__ = ["PipelineEngine", "StepResult", "SCHEDULE_CLASSES"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class SequenceCut(Protocol):
    """What the engine asks of a sequence cut (context parallelism): this rank's inputs and targets of a batch, its
    rank in the cut (rank 0 counts the samples), and the loss to run on the cut."""

    rank: int

    def inputs(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    def targets(self, targets: torch.Tensor) -> torch.Tensor: ...

    def loss(self, loss: Loss) -> Loss: ...


class PipelineEngine:
    """Runs one pipeline (`config.pp` ranks of `pp_group`) over a `BlockModel`, building only local blocks.

    Every rank of the pipeline calls `step`/`evaluate` with the same batch; the first stage reads `inputs`
    (a tensor, or a tuple of tensors for a first block with several arguments), the last reads `targets`.
    Pass the inputs on every rank when their shape varies between batches (sequence lengths): the shape
    picks the schedule. `loss_fn` is a `Loss` (e.g. `TokenCrossEntropy`) or a mean-reducing function (like
    `F.cross_entropy`, counted per sample). `wrap` (e.g. DDP or FSDP over the data-parallel group) is applied
    to each local stage module; `dp` is the number of replicas whose gradients it averages and `dp_group`
    their group, over which the count of a step (samples or non-padding tokens) is summed, so that the
    gradients are those of the mean over the global batch. One schedule is kept per micro-batch shape, at
    most `config.shape_cache` of them (least recently used dropped). `split_block(index, block)` (tensor
    parallelism, see `pipetrain.parallel.tensor`) is applied to each block as it is built, before `wrap`; a rank
    with `counts_metrics=False` (a tensor-parallel peer of one that counts) adds nothing to the step's metrics.
    `sequence_split` (context parallelism, `pipetrain.context.SequenceSplit`) cuts every batch's sequences to this
    rank's tokens before the run, and adapts the loss to the cut; `dp` and `dp_group` then span the data- and
    context-parallel ranks (each holds other tokens of the same parameters), and `StepResult.outputs` holds this
    rank's tokens. In training the last stage computes each micro-batch's loss and metrics inside its forward
    (`pipeline.head`), so its outputs (a language model's logits) are not held until the backward.

    BatchNorm layers (docs/batchnorm.md): each micro-batch is normalised by its own statistics; the running
    statistics move once per micro-batch forward (never in a recomputed forward), or once per step with
    `config.deferred_batchnorm`; after each step every data-parallel replica takes those of the first replica
    of `dp_group`, as DDP's `broadcast_buffers` makes them, under DDP and FSDP2 alike.
    """

    def __init__(
        self,
        model: BlockModel,
        config: PipelineConfig,
        *,
        device: torch.device,
        pp_group: dist.ProcessGroup | None = None,
        loss_fn: Loss | LossFn = F.cross_entropy,
        seed: int = 0,
        dp: int = 1,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        metrics_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        split_block: Callable[[int, nn.Module], nn.Module] | None = None,
        counts_metrics: bool = True,
        sequence_split: SequenceCut | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.sequence_split = sequence_split
        self.loss = as_loss(loss_fn) if sequence_split is None else sequence_split.loss(as_loss(loss_fn))
        #: the tensors the loss reads from the last block (`Loss.outputs`, 1 unless it says more: logits and a
        #: MoE model's auxiliary losses); `StepResult.outputs` holds the first
        self._reads = getattr(self.loss, "outputs", 1)
        self.dp = dp
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.metrics_group = metrics_group
        self.counts_metrics = counts_metrics
        #: whether `StepResult.outputs` holds the last stage's outputs (set False when nobody reads them)
        self.keep_outputs = True
        #: the training step's metric sums so far (`_weighted_loss` adds each micro-batch's); None outside a step
        self._sums: torch.Tensor | None = None
        group_size = dist.get_world_size(pp_group)
        if group_size != config.pp:
            raise ConfigError(
                f"pp={config.pp} but the pipeline group has {group_size} ranks",
                hint=f"launch dp * pp ranks with pp={group_size}, or pass --pp {group_size}",
            )
        self.pp_rank = dist.get_rank(pp_group)
        self.balance = resolve_balance(model, config)
        self._bounds = balance_bounds(self.balance)
        self.stage_ids = config.stage_ids(self.pp_rank)
        local = build_stages(model, config, self._bounds, self.stage_ids, seed=seed, device=device,
                             split_block=split_block, wrap=wrap)
        self._recompute: list[RecomputeWrapper] = local.recompute
        self._norms: list[StageNorms] = local.norms
        self.modules: list[nn.Module] = local.modules
        # tensor parallelism (`BlockSplit`): vocabulary-sharded logits; its sequence shards between stages: below
        self._loss_parallel = getattr(split_block, "loss_parallel", False)
        self._shapes = ShapeSchedules(
            model=model, config=config, modules=self.modules, stage_ids=self.stage_ids, bounds=self._bounds,
            device=device, group=pp_group, sequence_shards=getattr(split_block, "sequence_shards", 1),
            cut=sequence_split.inputs if sequence_split is not None else None)
        self.schedules = self._shapes.cache  #: the schedules kept, one per micro-batch shape
        self._shapes.shape_pass.check_outputs(model.example_input(1), reads=self._reads)
        self._loss_denominator = 1.0
        rank_of_stage = {stage: rank for rank in range(config.pp) for stage in config.stage_ids(rank)}  # V or looped
        rank_of_block = [rank_of_stage[stage] for stage, (a, z) in enumerate(self._bounds) for _ in range(a, z)]
        #: the model's tied weights (`BlockModel.tied_parameters`): copies kept equal, gradients summed per step
        self.tied = TiedWeights(model_ties(model, model.num_blocks), dict(self.named_parameters()), rank_of_block,
                                pp_group)
        self.tied.sync_values()
        #: expert parallelism's gradients (`parallel.experts.ExpertGradients`, set by the session): an object whose
        #: `take()` takes the gradients held before a step and whose `reduce(kept)` reduces the step's over the
        #: ranks holding the same experts, then adds the kept ones back; None without expert parallelism
        self.expert_grads = None
        #: the stage's expert-parallel group (whose ranks hold the other slices of each MoE layer's experts: the
        #: global gradient norm adds theirs), set by the session; None without expert parallelism
        self.expert_group: dist.ProcessGroup | None = None
        self.expert_mesh = None  #: that group's 1-D device mesh (checkpoints write expert slices as its shards)

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
        yield from block_named(self._recompute, self.stage_ids, self._bounds)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (BatchNorm running statistics...) named as `named_parameters` names parameters."""
        yield from block_named(self._recompute, self.stage_ids, self._bounds, buffers=True)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of activations the last step moved to host memory (`PipelineConfig.offload_activations`)."""
        return sum(w.offload.offloaded_bytes for w in self._recompute if w.offload is not None)

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)

    # ---- running -------------------------------------------------------------------------------------

    def step(self, inputs: Tensors | None, targets: torch.Tensor | None, *, global_count: int | None = None,
             global_batch_size: int | None = None) -> StepResult:
        """Forward and backward of one batch; gradients are left in `parameters()` for the optimizer.

        `global_count` is what the loss counts (samples, or non-padding tokens) summed over the data-parallel
        replicas; by default it is summed over `dp_group` (or this batch's count × dp without a group).
        `global_batch_size` is its old name (deprecated; it will be removed after 0.2).
        """
        if global_batch_size is not None:
            if global_count is not None:
                raise TypeError("step() got both global_count and its deprecated name global_batch_size")
            warnings.warn("PipelineEngine.step(global_batch_size=) is deprecated: pass global_count= (the same "
                          "number for a per-sample loss)", DeprecationWarning, stacklevel=2)
            global_count = global_batch_size
        self.train(True)
        kept = self.tied.take_grads()
        experts_kept = self.expert_grads.take() if self.expert_grads is not None else None
        result = self._run(inputs, targets, train=True, global_count=global_count)
        if self.expert_grads is not None:
            self.expert_grads.reduce(experts_kept)
        self.tied.reduce_grads(kept)  # tied copies: this step's gradients summed over every copy
        self._settle_statistics()
        return result

    def _settle_statistics(self) -> None:
        """After a step: commit deferred BatchNorm statistics, then give every replica the first replica's."""
        for norms in self._norms:
            norms.commit()
        statistics = [t for norms in self._norms for t in norms.statistics()]
        if statistics and self.dp > 1 and self.dp_group is not None:
            share_statistics(statistics, self.dp_group)

    @torch.no_grad()
    def evaluate(self, inputs: Tensors | None, targets: torch.Tensor | None, *, rows: int | None = None) -> StepResult:
        """Forward-only pass of one batch in eval mode; returns the metrics on every rank. `rows`: the metrics (and
        outputs) of the first `rows` rows only (None: all); the rest pad a replica's share to the others' size."""
        self.train(False)
        try:
            return self._run(inputs, targets, train=False, global_count=None, rows=rows)
        finally:
            self.train(True)

    def _run(self, inputs: Tensors | None, targets: torch.Tensor | None, *, train: bool,
             global_count: int | None, rows: int | None = None) -> StepResult:
        inputs = as_tuple(inputs) if inputs is not None else None
        if self.sequence_split is not None:  # context parallelism: this rank's tokens of every sequence
            inputs = self.sequence_split.inputs(inputs) if inputs is not None else None
            targets = self.sequence_split.targets(targets) if targets is not None else None
        reference = inputs[0] if inputs else targets
        if reference is None:
            raise ConfigError("step() got neither inputs nor targets", hint="pass the batch on every rank")
        batch_size = reference.shape[0]
        runs = plan_runs(batch_size, self.config.n_microbatches)
        targets = targets.to(self.device) if targets is not None else None
        if train and self.has_last_stage:
            self._loss_denominator = global_count_of(self.loss, targets, global_count, dp=self.dp, group=self.dp_group,
                                                     device=self.device) / self.dp
        for wrapper in self._recompute:
            wrapper.start_step(sum(run.count for run in runs))
        local = tuple(t.to(self.device) for t in inputs) if inputs is not None and self.has_first_stage else None
        # training: the last stage's forward computes each micro-batch's loss and metrics (`_weighted_loss`, in a
        # `LossHead`) and returns the loss, so neither the schedule nor the engine holds its outputs (the logits)
        # unless the caller reads them (`keep_outputs`: the head keeps them, detached)
        self._sums = zero_sums(self.loss, self.device) if train else None
        outputs: list[Tensors] = []
        offset = 0
        for run in runs:
            part = slice(offset, offset + run.samples)
            offset += run.samples
            schedule, fresh = self._shapes.get(run, train, inputs)
            args = tuple(t[part] for t in local) if local is not None else ()
            target = targets[part] if targets is not None and self.has_last_stage and train else None
            head = LossHead(self._weighted_loss, target, run.count, keep=self.keep_outputs) \
                if target is not None else None
            with grads_kept(self.parameters(), fresh), vocab_parallel(self._loss_parallel and train), \
                    armed(self._last_wrapper(), head):
                out = schedule.step(*args, target=target, return_outputs=False) if train else schedule.eval(*args)
            if head is not None:
                outputs += head.outputs
            elif self.has_last_stage and not train:
                outputs.append(out)
        merged = merge_outputs(outputs, self._reads)
        sums, self._sums = self._sums, None
        if rows is not None:  # evaluation of a padded share: the counted rows alone
            merged, targets, batch_size = first_rows(merged, rows), first_rows(targets, rows), rows
        return self._metrics(merged, targets, batch_size, refuse_empty=train and global_count is None, sums=sums)

    def _last_wrapper(self) -> RecomputeWrapper | None:
        """The last stage's recomputation wrapper (whose forward computes the loss, `pipeline.head`), if held here."""
        return self._recompute[self.stage_ids.index(self.num_stages - 1)] if self.has_last_stage else None

    def _weighted_loss(self, output: Tensors, target: torch.Tensor) -> torch.Tensor:
        # the micro-batch's loss total over the global count, times dp (which DDP/FSDP divide by)
        total = self.loss.total(output, target)
        if self._sums is not None:  # training: the metrics of this micro-batch, now
            with torch.no_grad():
                # vocabulary-sharded logits made whole on every tensor-parallel rank (a collective), counted by one
                made_whole = tuple(whole(t) for t in output) if isinstance(output, tuple) else whole(output)
                if self.counts_metrics:
                    add_sums(self.loss, self._sums, made_whole, target, total.detach())
        return total / self._loss_denominator

    def _metrics(self, outputs: Tensors | None, targets: torch.Tensor | None, batch_size: int, *,
                 refuse_empty: bool = False, sums: torch.Tensor | None = None) -> StepResult:
        """The step's metrics on every rank, from device-side sums (`sums`, summed micro-batch by micro-batch in
        training; else computed here from the merged `outputs`)."""
        totals = zero_sums(self.loss, self.device) if sums is None else sums
        if sums is None and outputs is not None and targets is not None and len(targets) and self.counts_metrics:
            add_sums(self.loss, totals, outputs, targets)
        if self.has_last_stage and targets is not None and self.counts_metrics:
            totals[2] = batch_size if self.sequence_split is None or self.sequence_split.rank == 0 else 0
        return step_result(self.loss, totals, outputs, group=self.metrics_group, keep_outputs=self.keep_outputs,
                           refuse_empty=refuse_empty)
