"""Evaluation batches: each global batch of an evaluation split cut over the data-parallel replicas so that every
sample counts exactly once under any dp.

Training cuts a global batch into equal shares and skips the fewer than `replicas` samples left over
(`position.replica_shares`): its gradients need equal weights. An evaluation must not skip any: the held-out loss
at dp 4 is the one at dp 1. Every replica builds the global batch whole (the same rows, padded as at dp 1) and
takes its contiguous share of `ceil(samples / replicas)` samples; a share that runs past the batch's end (the last
replicas of a short batch, some with no sample at all) is filled up with the batch's last sample, so every replica
runs a batch of the same size (FSDP gathers the weights for each forward: a replica that ran fewer would leave the
others waiting), and only its leading rows count (`PipelineEngine.evaluate(rows=)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pipetrain.workloads.base import Batch, Dataset, Workload
from pipetrain.workloads.text.batching import check_batching

__all__ = ["evaluation_share", "evaluation_batches"]


def evaluation_share(samples: int, *, replica: int, replicas: int) -> tuple[torch.Tensor, int]:
    """Replica `replica`'s share of a global batch of `samples` samples: the indices of the `ceil(samples /
    replicas)` samples it runs (those past the end repeat the last sample) and how many of them, leading, count."""
    check_batching(replicas, replica, replicas)  # `replica` one of `replicas`
    width = -(-samples // replicas)
    start = replica * width
    counted = max(0, min(width, samples - start))
    return torch.arange(start, start + width).clamp(max=samples - 1), counted


def _rows(value: torch.Tensor | tuple[torch.Tensor, ...], index: torch.Tensor) -> Any:
    return tuple(t[index] for t in value) if isinstance(value, tuple) else value[index]


def evaluation_batches(workload: Workload, dataset: Dataset, batch_size: int, *, seed: int, replica: int,
                       replicas: int, bucket: bool = False) -> Iterator[tuple[Batch, int]]:
    """This replica's share of each global batch of `dataset` (stored order, `batch_size` samples) as `((inputs,
    targets), counted rows)`: the same number of batches, each of the same size, on every replica; each sample of
    the split counted by exactly one of them."""
    per = getattr(workload, "rows_per_sample", 1)  # a workload of its own may predate the attribute
    for inputs, targets in workload.batches(dataset, batch_size, shuffle=False, seed=seed, epoch=0, replica=0,
                                            replicas=1, bucket=bucket):
        samples = len(targets) // per
        index, counted = evaluation_share(samples, replica=replica, replicas=replicas)
        rows = (index[:, None] * per + torch.arange(per)).flatten()
        yield (_rows(inputs, rows), targets[rows]), counted * per
