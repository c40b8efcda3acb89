"""Losses as sums and counts, so the engine can normalise them over the global batch exactly.

A pipeline computes the loss one micro-batch at a time, on every data-parallel replica. The mean over
the global batch is the sum of every micro-batch's loss total divided by the global count (samples, or
non-padding tokens), which the engine knows before the step. A mean of per-micro-batch means would
weight tokens unequally as soon as micro-batches hold different numbers of non-padding tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

__all__ = ["Loss", "SampleMeanLoss", "TokenCrossEntropy", "as_loss", "IGNORE_INDEX", "vocab_parallel", "vocab_argmax"]

#: The target value a token loss skips (padding); `F.cross_entropy`'s default.
IGNORE_INDEX = -100


@runtime_checkable
class Loss(Protocol):
    """A loss the engine can normalise: `total` sums over what `count` counts.

    Optional: a class attribute `outputs` (default 1), how many tensors it reads from the model's last block; above 1,
    `total` and `correct` get them as a tuple (e.g. a mixture of experts' logits and per-micro-batch auxiliary
    losses, `pipetrain.moe.router.RouterAuxLoss`) and `StepResult.outputs` holds the first."""

    #: whether exp(mean loss) is a perplexity (cross-entropies)
    perplexity: bool

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss summed over the counted units of this (micro-)batch (a scalar tensor)."""
        ...

    def count(self, target: torch.Tensor) -> int | torch.Tensor:
        """How many units (samples, non-padding tokens) `total` sums over (a 0-d tensor stays on the device: the
        engine then reads it with the step's other metrics, in one host sync)."""
        ...

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> int | torch.Tensor | None:
        """How many counted units the output predicts right (None when accuracy means nothing; a 0-d tensor as
        for `count`)."""
        ...

    # Optional: a loss with figures of its own sets `extra_names` (a tuple of names) and `extras(output, target)`,
    # their sums over what `count` counts (a dict of 0-d tensors); the engine reports their means in
    # `StepResult.extras` (a preference loss's `rewards/chosen`, ...).


@dataclass(frozen=True)
class SampleMeanLoss:
    """A mean-reducing loss function (`F.cross_entropy`, `F.mse_loss`, ...) counted per sample.

    Accuracy is reported when outputs are class logits `[batch, classes]` of integer labels `[batch]`.
    """

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @property
    def perplexity(self) -> bool:
        return False

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fn(output, target) * output.shape[0]

    def count(self, target: torch.Tensor) -> int:
        return target.shape[0]

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        if output.dim() != 2 or target.dim() != 1 or target.is_floating_point():
            return None
        return (output.argmax(dim=1) == target).sum()


@dataclass(frozen=True)
class TokenCrossEntropy:
    """Cross-entropy per token: logits `[..., vocab]`, integer targets `[...]` (any shape, e.g. `[batch, seq]`).

    Targets equal to `ignore_index` (padding) count for nothing: the loss and its gradients are the mean
    over the non-padding tokens of the global batch. Accuracy is per non-padding token. Logits that are a
    DTensor sharded on the vocabulary (the vocabulary-parallel head) give the same sum, computed where the
    shards lie: call it, and the backward, inside `vocab_parallel(True)` (the engine does).
    """

    ignore_index: int = IGNORE_INDEX
    perplexity: bool = True

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output.reshape(-1, output.shape[-1])
        total = F.cross_entropy(logits, target.reshape(-1), ignore_index=self.ignore_index, reduction="sum")
        # vocabulary-parallel: a replicated DTensor whose local value is the whole sum (backward: loss_parallel's)
        return total.to_local() if isinstance(total, DTensor) else total

    def count(self, target: torch.Tensor) -> torch.Tensor:
        return (target != self.ignore_index).sum()

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        return ((vocab_argmax(output) == target) & (target != self.ignore_index)).sum()


@torch.no_grad()
def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` as a plain tensor; for a DTensor sharded evenly on its last dimension (the vocabulary),
    without making the logits whole: each rank's maximum and its index are gathered (two small all-gathers) and the
    first shard holding the largest wins, as torch's argmax takes the first maximum."""
    if not isinstance(logits, DTensor):
        return logits.argmax(dim=-1)
    local = logits.to_local()
    group, ranks = logits.device_mesh.get_group(), logits.device_mesh.size()
    value, index = local.max(dim=-1)
    values, indices = [torch.empty_like(value) for _ in range(ranks)], [torch.empty_like(index) for _ in range(ranks)]
    dist.all_gather(values, value.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    shard = torch.stack(values).argmax(dim=0, keepdim=True)  # the first shard holding the maximum
    return torch.stack(indices).gather(0, shard)[0] + shard[0] * local.shape[-1]


def vocab_parallel(enabled: bool) -> AbstractContextManager[None]:
    """torch's `loss_parallel()` (cross-entropy of vocabulary-sharded DTensor logits, forward and backward)
    when `enabled`, else nothing."""
    return loss_parallel() if enabled else nullcontext()


def as_loss(loss: Loss | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Loss:
    """`loss` itself when it is a `Loss`, else the mean-reducing function `loss` counted per sample."""
    return loss if isinstance(loss, Loss) else SampleMeanLoss(loss)
