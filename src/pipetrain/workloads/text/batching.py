"""Batches of a dataset: a random stream per (seed, name), equal shares per replica, and length bucketing (a batch
order that puts samples of similar lengths together, and the padded batch length)."""

from __future__ import annotations

import hashlib
from collections.abc import Sized

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.text.words import positive

__all__ = ["random_stream", "check_batching", "num_batches", "LENGTH_STEP", "MAX_LENGTHS", "batch_order", "length_step", "padded_length"]

def random_stream(seed: int, stream: str) -> torch.Generator:
    """An independent random stream per `(seed, stream)`."""
    digest = hashlib.blake2b(f"{seed}:{stream}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def check_batching(batch_size: int, replica: int, replicas: int) -> None:
    """Raise ConfigError unless `batch_size` splits into `replicas` equal shares and `replica` is one of them."""
    positive("batch_size", batch_size)
    positive("replicas", replicas)
    if batch_size % replicas:
        raise ConfigError(
            f"global batch size {batch_size} is not divisible by {replicas} replicas",
            hint=f"pass a multiple of {replicas}, e.g. --batch-size {replicas * max(1, batch_size // replicas)}",
        )
    if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < replicas:
        raise ConfigError(
            f"replica {replica!r} is out of range for {replicas} replicas",
            hint=f"pass replica in 0..{replicas - 1}",
        )


def num_batches(
    dataset: Sized | int, batch_size: int, *, replicas: int = 1, drop_last: bool = False
) -> int:
    """How many batches `batches` yields per epoch to each replica (the same number for every replica)."""
    check_batching(batch_size, 0, replicas)
    size = dataset if isinstance(dataset, int) else len(dataset)
    full, rest = divmod(size, batch_size)
    return full + (1 if rest and not drop_last and rest >= replicas else 0)


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
