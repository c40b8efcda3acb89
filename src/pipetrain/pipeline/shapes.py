"""Stage boundary tensors found by running the blocks on the meta device (no memory, no compute)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipetrain.blocks import BlockModel, Tensors, as_tuple
from pipetrain.errors import ConfigError

__all__ = ["Signature", "signature", "meta_blocks", "crossing_tensors", "boundary_tensors", "check_model_outputs"]

#: Shapes and dtypes of a tuple of tensors: what a schedule's buffers are sized from.
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def signature(tensors: Sequence[torch.Tensor]) -> Signature:
    """The shapes and dtypes of `tensors`, hashable (a cache key)."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def meta_blocks(model: BlockModel) -> list[nn.Module]:
    """Every block of `model` on the meta device (parameters without storage)."""
    with torch.device("meta"):
        return [model.build_block(i).to("meta") for i in range(model.num_blocks)]


def crossing_tensors(value: object, index: int, block: nn.Module) -> tuple[torch.Tensor, ...]:
    """`value` (what block `index` returned) as a tuple of tensors; ConfigError if it cannot cross a stage."""
    values = value if isinstance(value, tuple) else (value,)
    bad = [v for v in values if not isinstance(v, torch.Tensor)]
    if bad or not values:
        what = f"a {type(bad[0]).__name__} ({bad[0]!r:.40})" if bad else "an empty tuple"
        raise ConfigError(
            f"block {index} ({type(block).__name__}) returned {what}, which cannot cross a pipeline stage",
            hint="make every block return a tensor or a tuple of tensors (store constants as buffers, "
                 "turn Python numbers into tensors with a batch dimension)",
        )
    return values


def boundary_tensors(
    blocks: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], inputs: Tensors, *, train: bool
) -> list[tuple[torch.Tensor, ...]]:
    """Meta tensors at every stage boundary for one micro-batch `inputs`: stage k reads entry k, writes k+1.

    `blocks` are the meta blocks (`meta_blocks`), `inputs` the first block's input(s) (any device: only
    shapes count). With `train`, each tensor's `requires_grad` says whether it carries a gradient at run
    time: stage inputs received from another stage require grad when the sending stage computed them from
    parameters (integer and boolean tensors never do). Giving `PipelineStage` these tensors up front avoids
    its hidden shape-inference forward on garbage inputs (which would move BatchNorm statistics and the
    dropout RNG).
    """
    values = tuple(torch.empty_like(t, device="meta") for t in as_tuple(inputs))
    boundaries = [values]
    with torch.set_grad_enabled(train):
        for start, stop in bounds:
            values = tuple(t.detach().requires_grad_(t.requires_grad) for t in values)
            for index in range(start, stop):
                values = crossing_tensors(blocks[index](*values), index, blocks[index])
            boundaries.append(tuple(t.detach().requires_grad_(t.requires_grad) for t in values))
    return boundaries


def check_model_outputs(blocks: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], inputs: Tensors) -> None:
    """Raise ConfigError, before any step, if a block returns something that cannot cross a stage or the last
    block returns more than the one tensor the loss reads (a meta run of `inputs`)."""
    last = boundary_tensors(blocks, bounds, inputs, train=False)[-1]
    if len(last) != 1:
        index = bounds[-1][1] - 1
        raise ConfigError(
            f"the last block ({index}, {type(blocks[index]).__name__}) returns {len(last)} tensors, "
            "but the loss reads one",
            hint="make the last block return only the tensor the loss compares with the targets",
        )
