"""Length bucketing: a batch order that puts samples of similar lengths together, and the padded batch length."""

from __future__ import annotations

import torch

from pipetrain.workloads.imdb import random_stream

__all__ = ["LENGTH_STEP", "MAX_LENGTHS", "batch_order", "length_step", "padded_length"]

#: Batch lengths are rounded up to a multiple of this, bounding the number of shapes (schedules) per epoch.
LENGTH_STEP = 8
#: `length_step` keeps the batch lengths of one window to this many: the engine's default `--shape-cache` (16
#: schedules) then holds them all, instead of rebuilding a schedule for most batches of a long window.
MAX_LENGTHS = 16


def batch_order(lengths: torch.Tensor, batch_size: int, *, shuffle: bool, bucket: bool, seed: int, stream: str,
                bucket_stream: str) -> torch.Tensor:
    """The order of the samples for one epoch; consecutive runs of `batch_size` are the global batches.

    Shuffled by the random stream `(seed, stream)` when `shuffle`, else in stored order. With `bucket`, samples
    are then sorted by length (a stable sort keeps the shuffle among equal lengths) and the full batches, not
    the samples, are put in random order (stream `bucket_stream`), a last short batch staying last (so that
    cutting the order every `batch_size` samples gives back the buckets): every batch holds similar lengths
    and needs little padding.
    """
    size = len(lengths)
    order = torch.randperm(size, generator=random_stream(seed, stream)) if shuffle else torch.arange(size)
    if not bucket:
        return order
    order = order[torch.sort(lengths[order], stable=True).indices]
    starts = torch.arange(0, size - size % batch_size, batch_size)
    if shuffle:
        starts = starts[torch.randperm(len(starts), generator=random_stream(seed, bucket_stream))]
    if size % batch_size:
        starts = torch.cat([starts, torch.tensor([size - size % batch_size])])
    return torch.cat([order[s : s + batch_size] for s in starts.tolist()])


def length_step(limit: int, max_lengths: int = MAX_LENGTHS) -> int:
    """The smallest multiple of `LENGTH_STEP` that cuts lengths up to `limit` into at most `max_lengths` steps."""
    per_step = -(-limit // max_lengths)
    return max(1, -(-per_step // LENGTH_STEP)) * LENGTH_STEP


def padded_length(lengths: torch.Tensor, limit: int, step: int = LENGTH_STEP) -> int:
    """The longest of `lengths` rounded up to a multiple of `step`, at most `limit`."""
    longest = max(int(lengths.max()), 1)
    return min(limit, -(-longest // step) * step)
