"""The data position: which samples each replica trains next, a pure function of an epoch's sample order and a
global sample index, so that a job resumed under any dp, pp or tp goes on with exactly the samples the uninterrupted
job would have trained next — by seeking to the index, never by reading the skipped batches again.

An epoch's order (`batch_order`, a function of the seed and the epoch) lists every sample index once; the global
batches are its consecutive runs of `batch_size` from global sample `start` on (0 at the start of an epoch, what a
checkpoint saved when resumed), and replica `r` of `R` trains the `r`-th of `R` equal contiguous shares of each
(see `imdb.batches`). Neither the order nor the cut depend on the number of replicas, stages or tensor ranks."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.text.batching import check_batching, num_batches

__all__ = ["check_start", "replica_shares", "batches_left"]


def check_start(start: int, size: int) -> None:
    """Raise ConfigError unless `start` is a sample index of an epoch of `size` samples (or its end)."""
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= size:
        raise ConfigError(f"data position {start!r} is outside an epoch of {size} samples",
                          hint="resume from a checkpoint of this job's data (same --data, --seed and --batch-size)")


def batches_left(size: int, batch_size: int, *, replicas: int = 1, start: int = 0, drop_last: bool = False) -> int:
    """How many global batches an epoch of `size` samples has from global sample `start` on (the count every
    replica gets; `num_batches` when `start` is 0)."""
    check_start(start, size)
    return num_batches(size - start, batch_size, replicas=replicas, drop_last=drop_last) if size > start else 0


def replica_shares(order: torch.Tensor, batch_size: int, *, replica: int, replicas: int, start: int = 0,
                   drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For each global batch of `order` from global sample `start` on: `(global batch, this replica's share)`, both
    sample indices. The share is `len(global batch) // replicas` samples (a last short batch smaller than `replicas`
    is dropped, its few left-over samples skipped this epoch); nothing before `start` is touched."""
    check_batching(batch_size, replica, replicas)
    check_start(start, len(order))
    rest = order[start:]
    for index in range(batches_left(len(order), batch_size, replicas=replicas, start=start, drop_last=drop_last)):
        global_batch = rest[index * batch_size : (index + 1) * batch_size]
        share = len(global_batch) // replicas
        yield global_batch, global_batch[replica * share : (replica + 1) * share]
