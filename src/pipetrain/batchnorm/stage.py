"""The batch norms of one stage module: frozen during a recomputed forward, deferred, shared over data parallelism."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.batchnorm.deferred import DeferredStatistics
from pipetrain.compat.modules import is_batch_norm

__all__ = ["StageNorms", "share_statistics"]


class StageNorms:
    """Every batch norm of `module` that keeps running statistics (none: every method does nothing).

    `recomputing()` is the context of a recomputed forward (activation checkpointing re-runs the forward in the
    backward pass): a batch norm normalises there as in the first forward (by the input's own statistics), and its
    running statistics and `num_batches_tracked` are then put back, so they move once per forward, as without
    recomputation. With `deferred`, the running statistics are updated once per step by `commit()`, from the
    whole mini-batch (see `DeferredStatistics`).
    """

    def __init__(self, module: nn.Module, *, deferred: bool = False) -> None:
        self.norms = [m for m in module.modules() if is_batch_norm(m) and m.track_running_stats
                      and m.running_mean is not None]
        self.deferred = [DeferredStatistics(norm) for norm in self.norms] if deferred else []

    def recomputing(self) -> _Recomputing:
        """The context of a recomputed forward: inside, training forwards leave the running statistics as they found
        them (and record nothing deferred). The recomputed forward must save the tensors the first one saved
        (`torch.utils.checkpoint` checks it), so the batch norms run unchanged and their running statistics are put
        back afterwards. Reusable: a split backward (zero-bubble schedules) recomputes once per half."""
        return _Recomputing(self)

    def commit(self) -> None:
        """Deferred: apply this step's update to every running statistic (else nothing to do)."""
        for stats in self.deferred:
            stats.commit()

    def statistics(self) -> list[torch.Tensor]:
        """The running statistics' tensors (mean, variance, `num_batches_tracked`) of every batch norm."""
        return [t for norm in self.norms for t in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
                if t is not None]


class _Recomputing:
    """`StageNorms.recomputing()`: a context manager that can be entered again after it exits."""

    def __init__(self, norms: StageNorms) -> None:
        self._norms = norms
        self._kept: list[torch.Tensor] = []

    def __enter__(self) -> None:
        self._kept = [t.clone() for t in self._norms.statistics()]
        for stats in self._norms.deferred:
            stats.paused = True

    def __exit__(self, *exc: object) -> None:
        for stats in self._norms.deferred:
            stats.paused = False
        for tensor, value in zip(self._norms.statistics(), self._kept):
            # written as the batch norm kernel writes them: without a new autograd version (`.data`), since the
            # recomputed graph saved these tensors and checks their version in the backward that follows
            tensor.data.copy_(value)
        self._kept = []


def share_statistics(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Overwrite `tensors` on every rank of `group` with the values of the group's first rank (one broadcast per
    dtype): what DDP's `broadcast_buffers=True` does with module buffers before each forward."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, group=group, group_src=0)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
