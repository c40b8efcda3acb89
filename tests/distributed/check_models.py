"""Small workloads for `pipetrain check` tests, named as `tests.distributed.check_models:NAME` (MODULE:NAME).

`sound` trains the same split as unsplit; `batch_stat` (block 2 normalises with its batch's mean) and
`counter` (block 2 scales by a Python-side call count) do not; `hazards` passes but carries every hazard
the check reports without failing (dropout, a non-persistent buffer, a plain tensor attribute, an unused
parameter).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tests.fixtures.points import Points, PointsWorkload

WIDTH, BLOCKS = 8, 6


class BatchMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h - h.mean(dim=0, keepdim=True)  # batch statistics: micro-batching changes them


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # hidden Python-side state: every micro-batch calls it once more
        return self.linear(x) * (1 + 0.1 * self.calls)


class Hazardous(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.5)
        self.register_buffer("scale", torch.ones(WIDTH), persistent=False)
        self.offset = torch.zeros(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.tanh(self.linear(x))) * self.scale + self.offset


def _plain() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


class ToyModel:
    def __init__(self, special: Callable[[], nn.Module] | None) -> None:
        self.special = special

    num_blocks = BLOCKS

    def build_block(self, index: int) -> nn.Module:
        if index == BLOCKS - 1:
            return nn.Linear(WIDTH, 3)
        return self.special() if index == 2 and self.special is not None else _plain()

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, WIDTH)


class ToyWorkload(PointsWorkload):
    name = "toy"
    summary = "6 small blocks; block 2 may be special"

    def __init__(self, special: Callable[[], nn.Module] | None = None) -> None:
        self.special = special

    def model(self, preset: str, *, seq_len: int | None = None) -> ToyModel:
        self.check_preset(preset)
        self.check_window(seq_len)
        return ToyModel(self.special)

    def points(self, n: int, seed: int) -> Points:
        gen = torch.Generator().manual_seed(seed)
        return Points(torch.randn(n, WIDTH, generator=gen), torch.randint(0, 3, (n,), generator=gen))


sound = ToyWorkload()
batch_stat = ToyWorkload(BatchMean)
counter = ToyWorkload(Counter)
hazards = ToyWorkload(Hazardous)
not_a_workload = 42
