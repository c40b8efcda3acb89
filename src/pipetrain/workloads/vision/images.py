"""Synthetic labelled images: each class a fixed random pattern, each image its class's pattern under noise (learnable
in a few steps, deterministic for a seed)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["Images", "synthetic_images", "image_batches", "num_image_batches"]


@dataclass(frozen=True)
class Images:
    """Images `[n, channels, size, size]` and their class labels `[n]`."""

    images: torch.Tensor
    labels: torch.Tensor
    synthetic: bool = True
    source: str = "synthetic images"

    def __len__(self) -> int:
        return len(self.labels)


def synthetic_images(n: int, *, classes: int, channels: int, size: int, seed: int, noise: float = 1.0) -> Images:
    """`n` images: class `c`'s pattern (the same for every seed: the train and test sets share it) plus Gaussian
    noise of standard deviation `noise`, labels drawn uniformly under `seed`."""
    patterns = torch.randn(classes, channels, size, size, generator=torch.Generator().manual_seed(12345))
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    images = patterns[labels] + noise * torch.randn(n, channels, size, size, generator=gen)
    return Images(images, labels)


def num_image_batches(dataset: Images, batch_size: int) -> int:
    """Whole batches per epoch (the last, incomplete one is dropped: BatchNorm and micro-batches want full ones)."""
    return len(dataset) // batch_size


def image_batches(dataset: Images, batch_size: int, *, shuffle: bool, seed: int, epoch: int, replica: int,
                  replicas: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of this replica's share of each global batch of `batch_size` images."""
    order = (torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
             if shuffle else torch.arange(len(dataset)))
    share = batch_size // replicas
    for start in range(0, num_image_batches(dataset, batch_size) * batch_size, batch_size):
        mine = order[start + replica * share : start + (replica + 1) * share]
        yield dataset.images[mine], dataset.labels[mine]
