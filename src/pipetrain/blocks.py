"""A model as an ordered list of blocks that each rank can build one at a time (never the whole model)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["BlockModel", "ModuleListModel", "build_blocks", "build_sequential", "block_seed"]


@runtime_checkable
class BlockModel(Protocol):
    """What pipetrain needs from a model: how many blocks, how to build block `i`, and a sample input."""

    @property
    def num_blocks(self) -> int:
        """Number of blocks in order; stages are contiguous runs of them."""
        ...

    def build_block(self, index: int) -> nn.Module:
        """Build block `index` (on the current default device; may be the meta device)."""
        ...

    def example_input(self, batch_size: int) -> torch.Tensor:
        """A first-block input of `batch_size` samples (its values may be garbage; only shape/dtype count)."""
        ...


class ModuleListModel:
    """Adapts an existing `nn.Sequential` (or list of modules) to `BlockModel`; each block is deep-copied.

    Convenient for small models; for a model larger than one device, write a `BlockModel` whose
    `build_block` constructs only the requested block.
    """

    def __init__(self, modules: Sequence[nn.Module] | nn.Sequential, example_input: torch.Tensor) -> None:
        self._modules = list(modules)
        self._example = example_input

    @property
    def num_blocks(self) -> int:
        return len(self._modules)

    def build_block(self, index: int) -> nn.Module:
        return copy.deepcopy(self._modules[index])

    def example_input(self, batch_size: int) -> torch.Tensor:
        reps = [1] * self._example.dim()
        reps[0] = -(-batch_size // self._example.shape[0])
        return self._example.repeat(*reps)[:batch_size]


def block_seed(seed: int, index: int) -> int:
    """The RNG seed block `index` is initialised under, so any rank builds the same weights."""
    return seed * 100_003 + index


def build_blocks(
    model: BlockModel, indices: Sequence[int], *, seed: int, device: torch.device | str = "cpu"
) -> list[nn.Module]:
    """Build the blocks `indices` of `model` on `device`, each under its own seed (see `block_seed`)."""
    blocks = []
    for index in indices:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(block_seed(seed, index))
            blocks.append(model.build_block(index).to(device))
    return blocks


def build_sequential(model: BlockModel, *, seed: int, device: torch.device | str = "cpu") -> nn.Sequential:
    """The whole model on one device: the single-process reference the pipelined runs must match."""
    return nn.Sequential(*build_blocks(model, range(model.num_blocks), seed=seed, device=device))
