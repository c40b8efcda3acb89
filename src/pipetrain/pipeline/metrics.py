"""A step's metrics: device-side sums of each micro-batch's loss, count and accuracy, reduced over the job in one
host sync, and the `StepResult` every rank gets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipetrain.blocks import Tensors
from pipetrain.errors import ConfigError
from pipetrain.pipeline.loss import Loss
from pipetrain.pipeline.timeline import span

__all__ = ["StepResult", "whole", "global_count_of", "merge_outputs", "first_rows", "zero_sums", "add_sums",
           "step_result"]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A vocabulary-sharded DTensor made whole (the metrics read every class); any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class StepResult:
    """Metrics of one step or evaluation, identical on every rank (reduced over the whole job).

    `loss` is the mean over what the loss counts (`count`: the samples, or the non-padding tokens of a
    token loss); `accuracy` is the fraction of them predicted right (None unless outputs are logits of
    integer targets); `perplexity` is exp(loss) for a token cross-entropy (else None). `outputs` holds the
    last stage's merged outputs on the rank(s) that own it (None elsewhere, and None when the engine's
    `keep_outputs` is False: a loop that never reads them, such as `pipetrain train`, need not hold the logits).
    `extras`: the means over `count` of the figures a loss names in `extra_names` (e.g. a preference loss's
    `rewards/chosen`), empty for a loss without them.
    """

    loss: float
    accuracy: float | None
    samples: int
    outputs: torch.Tensor | None = None
    count: int = 0
    perplexity: float | None = None
    extras: dict[str, float] = field(default_factory=dict)


def global_count_of(loss: Loss, targets: torch.Tensor | None, given: int | None, *, dp: int,
                    group: dist.ProcessGroup | None, device: torch.device) -> float | torch.Tensor:
    """What the loss of this step is averaged over, across the `dp` data-parallel replicas of `group`: `given`, else
    a tensor on the device (no host sync; a batch of padding only is refused with the step's metrics)."""
    if given is not None:
        return float(given)
    if targets is None:
        raise ConfigError("the last pipeline stage got no targets", hint="pass the targets on every rank")
    count = torch.as_tensor(loss.count(targets), dtype=torch.float64, device=device).reshape(1)
    if dp > 1 and group is not None:
        dist.all_reduce(count, group=group)
    else:
        count = count * dp
    return count[0]


def merge_outputs(outputs: list[Tensors], reads: int) -> Tensors | None:
    """The last stage's outputs of a batch's runs merged (`reads` tensors each: merged one by one), made whole if
    vocabulary-sharded; None without any."""
    # one run: the schedule's merged output as it is (a copy more of the step's outputs would be held for nothing)
    if reads > 1:  # several tensors: each merged over the runs, the loss reads them together
        merged = tuple(parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*outputs)) \
            if outputs else None
    else:
        merged = (outputs[0] if len(outputs) == 1 else torch.cat(outputs)) if outputs else None
    if isinstance(merged, DTensor):  # vocabulary-sharded logits: whole for the metrics and the caller
        merged = merged.full_tensor()
    return merged


def first_rows(value: Tensors | None, rows: int) -> Tensors | None:
    """The first `rows` rows (batch entries) of a tensor or of each tensor of a tuple; None stays None."""
    if value is None:
        return None
    return tuple(t[:rows] for t in value) if isinstance(value, tuple) else value[:rows]


def zero_sums(loss: Loss, device: torch.device) -> torch.Tensor:
    """A step's metric sums (loss, count, samples, correct, classified, the loss's extras), on the device."""
    return torch.zeros(5 + len(getattr(loss, "extra_names", ())), dtype=torch.float64, device=device)


def add_sums(loss: Loss, sums: torch.Tensor, outputs: Tensors, targets: torch.Tensor,
             total: torch.Tensor | None = None) -> None:
    """Add the metrics of `outputs` (a micro-batch's or a batch's, not vocabulary-sharded) to `sums`;
    `total`: the loss total already computed on them."""
    sums[0] += (loss.total(outputs, targets) if total is None else total).double()
    sums[1] += loss.count(targets)
    correct = loss.correct(outputs, targets)
    if correct is not None:
        sums[3] += correct
        sums[4] = 1
    names = tuple(getattr(loss, "extra_names", ()))  # a loss's own figures (sums over what it counts)
    if names:
        extras = loss.extras(outputs, targets)
        sums[5:] += torch.stack([torch.as_tensor(extras[n], dtype=torch.float64, device=sums.device)
                                 for n in names])


def step_result(loss: Loss, totals: torch.Tensor, outputs: Tensors | None, *, group: dist.ProcessGroup | None,
                keep_outputs: bool, refuse_empty: bool = False) -> StepResult:
    """The step's loss, counts and accuracy on every rank from this rank's `totals`, summed over `group`: one host
    sync (`tolist`; the built-in losses count on the device)."""
    names = tuple(getattr(loss, "extra_names", ()))
    if dist.is_initialized():
        with span("metrics"):
            dist.all_reduce(totals, group=group)
    loss_sum, count, samples, correct, classified, *extra = totals.tolist()
    if refuse_empty and count == 0:  # every rank sees it: the same message everywhere, before the update
        raise ConfigError("every target of this batch is padding (ignore_index): nothing to learn from",
                          hint="drop batches without any non-padding target")
    mean = loss_sum / max(count, 1.0)
    return StepResult(
        loss=mean,
        accuracy=correct / max(count, 1.0) if classified else None,
        samples=int(samples),
        outputs=(outputs[0] if isinstance(outputs, tuple) else outputs) if keep_outputs else None,
        count=int(count),
        perplexity=math.exp(min(mean, 700.0)) if loss.perplexity else None,
        extras={name: value / max(count, 1.0) for name, value in zip(names, extra)},
    )
