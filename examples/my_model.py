"""A model of your own, trained from the command line: a residual MLP that tells the arms of a 2-D spiral apart.

    pipetrain train --workload examples/my_model.py:workload --preset tiny --pp 2
    pipetrain check --workload examples/my_model.py:workload --preset tiny --pp 2 --schedule gpipe

`workload` below is what `--workload FILE:NAME` names (a Workload instance; a subclass or a factory of one
works too). Every rank loads this file again, so keep it importable: no training at module level.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.workloads.registry import DataRequest, Workload


@dataclass(frozen=True)
class SpiralConfig:
    width: int
    layers: int
    arms: int = 3


PRESETS = {"tiny": SpiralConfig(width=16, layers=4), "cpu": SpiralConfig(width=64, layers=6)}


class Embed(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(2, width)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.linear(points)


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.linear(self.norm(x)))


class SpiralModel:
    """The `BlockModel`: embedding, `layers` residual blocks, a classification head; each rank builds its own."""

    def __init__(self, config: SpiralConfig) -> None:
        self.config = config

    @property
    def num_blocks(self) -> int:
        return self.config.layers + 2

    def build_block(self, index: int) -> nn.Module:
        if index == 0:
            return Embed(self.config.width)
        if index == self.num_blocks - 1:
            return nn.Linear(self.config.width, self.config.arms)
        return Residual(self.config.width)

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 2)


@dataclass(frozen=True)
class Spiral:
    """Points and their arm; a type of this file, so ranks unpickle it after loading the file."""

    points: torch.Tensor
    arms: torch.Tensor
    synthetic: bool = True
    source: str = "synthetic spiral points"

    def __len__(self) -> int:
        return len(self.arms)


def spiral(n: int, arms: int, seed: int) -> Spiral:
    gen = torch.Generator().manual_seed(seed)
    arm = torch.randint(0, arms, (n,), generator=gen)
    radius = torch.rand(n, generator=gen)
    angle = 3 * math.pi * radius + 2 * math.pi * arm / arms + 0.2 * torch.randn(n, generator=gen)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return Spiral(points, arm)


class SpiralWorkload(Workload):
    name = "spiral"
    summary = "a residual MLP classifying the arms of a 2-D spiral (synthetic points)"
    presets = PRESETS

    def model(self, preset: str, *, seq_len: int | None = None) -> SpiralModel:
        self.check_preset(preset)
        self.check_window(seq_len)
        return SpiralModel(PRESETS[preset])

    def load_data(self, request: DataRequest) -> tuple[Spiral, Spiral]:
        if request.path is not None:
            raise ConfigError(f"the spiral workload makes its own points, not {str(request.path)!r}",
                              hint="drop --data")
        arms = PRESETS[request.preset].arms
        return (spiral(request.train_samples, arms, request.seed),
                spiral(request.test_samples, arms, request.seed + 1))

    def batches(self, dataset: Spiral, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
                replica: int, replicas: int, bucket: bool = False,
                start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # the epoch's order depends on (seed, epoch) only; a resumed job starts at global sample `start` of it
        order = (torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
                 if shuffle else torch.arange(len(dataset)))
        share = batch_size // replicas
        for first in range(start, self.num_batches(dataset, batch_size, replicas=replicas) * batch_size, batch_size):
            mine = order[first + replica * share : first + (replica + 1) * share]
            yield dataset.points[mine], dataset.arms[mine]

    def num_batches(self, dataset: Spiral, batch_size: int, *, replicas: int) -> int:
        return len(dataset) // batch_size  # the last, incomplete batch is dropped

    def loss(self):
        return F.cross_entropy


workload = SpiralWorkload()
