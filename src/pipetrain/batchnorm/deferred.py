"""Deferred batch norm: a batch norm's running statistics accumulated over a step's micro-batches, committed once.

torchgpipe's `deferred_batch_norm=True` is the reference behaviour: every micro-batch is still normalised by its own
statistics (that is what a micro-batch is), but the running mean and variance are updated once per step, from the
mean and variance of the whole mini-batch, so they equal the unsplit model's. The micro-batches' means and variances
are combined exactly (Chan et al.'s pairwise update, in float64) rather than from sums of squares, and the committed
variance is the unbiased one, as `torch.nn.BatchNorm*d` keeps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["DeferredStatistics"]


class DeferredStatistics:
    """Defers the running-statistics update of one batch norm `norm` (a `torch.nn.BatchNorm*d` tracking them).

    From construction on, `norm` normalises each training forward by that input's own statistics and updates
    nothing itself (`track_running_stats` is switched off, which in eval mode still normalises by the running
    statistics); a forward pre-hook records each training input's per-channel mean and variance, unless `paused`
    (a recomputed forward); `commit()` applies the step's update as the unsplit forward of the whole mini-batch
    would, momentum (or the cumulative average when momentum is None) and `num_batches_tracked` included.
    """

    def __init__(self, norm: nn.Module) -> None:
        self.norm = norm
        self.paused = False
        self._count = 0
        self._mean = torch.zeros(0)
        self._m2 = torch.zeros(0)
        norm.track_running_stats = False
        self._handle = norm.register_forward_pre_hook(self._track)

    @property
    def pending(self) -> int:
        """Values per channel recorded since the last commit."""
        return self._count

    def _track(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not module.training or self.paused:
            return
        x = args[0].detach()
        if x.dtype not in (torch.float32, torch.float64):  # bf16 / fp16 activations: statistics in float32
            x = x.float()
        with torch.no_grad():
            var, mean = torch.var_mean(x, dim=[0, *range(2, x.dim())], correction=0)
            count = x.numel() // x.shape[1]
            mean, m2 = mean.double(), var.double() * count
            if self._count == 0:
                self._mean, self._m2 = mean, m2
            else:  # the two groups' means and sums of squared deviations, combined (Chan, Golub, LeVeque 1979)
                total = self._count + count
                delta = mean - self._mean
                self._mean = self._mean + delta * (count / total)
                self._m2 = self._m2 + m2 + delta.square() * (self._count * count / total)
            self._count += count

    @torch.no_grad()
    def commit(self) -> None:
        """Update the running statistics from everything recorded since the last commit (nothing when none was)."""
        if self._count == 0:
            return
        norm = self.norm
        tracked = norm.num_batches_tracked
        if tracked is not None:
            tracked.add_(1)
        factor = norm.momentum if norm.momentum is not None else 1.0 / float(tracked if tracked is not None else 1)
        var = self._m2 / max(self._count - 1, 1)  # unbiased, as the running variance of torch's batch norms
        for running, value in ((norm.running_mean, self._mean), (norm.running_var, var)):
            running.copy_(running.double() * (1 - factor) + value * factor)
        self._count = 0

    def remove(self) -> None:
        """Give `norm` back its own running-statistics updates (anything pending is dropped)."""
        self._handle.remove()
        self.norm.track_running_stats = True
        self._count = 0
