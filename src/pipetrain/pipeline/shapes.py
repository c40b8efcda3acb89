"""Stage boundary tensors found by running the blocks on the meta device (no memory, no compute)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch
from torch import nn

from pipetrain.blocks import BlockModel, Tensors, as_tuple
from pipetrain.errors import ConfigError

__all__ = ["Signature", "signature", "meta_blocks", "crossing_tensors", "boundary_tensors", "check_model_outputs",
           "sequence_shard", "check_sequence_length", "ShapePass"]

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


def sequence_shard(values: tuple[torch.Tensor, ...], shards: int) -> tuple[torch.Tensor, ...]:
    """`values` as a sequence-parallel stage sends them: each floating-point tensor of two or more dimensions cut
    to its `1 / shards` of dimension 1 (the sequence), other tensors whole; ConfigError when it does not divide."""
    if shards == 1:
        return values
    out = []
    for value in values:
        if value.is_floating_point() and value.dim() >= 2:
            check_sequence_length(value.shape[1], shards)
            shape = (value.shape[0], value.shape[1] // shards, *value.shape[2:])
            value = torch.empty(shape, dtype=value.dtype, device=value.device).requires_grad_(value.requires_grad)
        out.append(value)
    return tuple(out)


def check_sequence_length(length: int, shards: int) -> None:
    """Raise unless sequence parallelism over `shards` ranks can split a sequence of `length` evenly."""
    if length % shards:
        raise ConfigError(
            f"--sequence-parallel splits each sequence over tp={shards} ranks, but this batch's sequence "
            f"length {length} is not divisible by {shards}",
            hint=f"make every sequence length (each --bucket length too) a multiple of {shards}, "
                 "or drop --sequence-parallel",
        )


def boundary_tensors(
    blocks: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], inputs: Tensors, *, train: bool,
    sequence_shards: int = 1,
) -> list[tuple[torch.Tensor, ...]]:
    """Meta tensors at every stage boundary for one micro-batch `inputs`: stage k reads entry k, writes k+1.

    `blocks` are the meta blocks (`meta_blocks`), `inputs` the first block's input(s) (any device: only
    shapes count). With `train`, each tensor's `requires_grad` says whether it carries a gradient at run
    time: stage inputs received from another stage require grad when the sending stage computed them from
    parameters (integer and boolean tensors never do). Giving `PipelineStage` these tensors up front avoids
    its hidden shape-inference forward on garbage inputs (which would move BatchNorm statistics and the
    dropout RNG). `sequence_shards` (tp under sequence parallelism) cuts the tensors between stages as
    `sequence_shard` does; the first input and the last output stay whole. The blocks run in training mode only
    with `train` (a forward-only pass, or the check of the outputs, runs them as `evaluate` does, in eval mode:
    BatchNorm refuses a training batch of one sample); being meta copies, they move no real running statistics.
    """
    for block in blocks:
        block.train(train)
    values = tuple(torch.empty_like(t, device="meta") for t in as_tuple(inputs))
    if sequence_shards > 1 and values[0].dim() >= 2:  # the first input's dimension 1 is the sequence
        check_sequence_length(values[0].shape[1], sequence_shards)
    boundaries = [values]
    with torch.set_grad_enabled(train):
        for start, stop in bounds:
            values = tuple(t.detach().requires_grad_(t.requires_grad) for t in values)
            for index in range(start, stop):
                values = crossing_tensors(_shape_run(blocks[index], index, values, train), index, blocks[index])
            boundaries.append(tuple(t.detach().requires_grad_(t.requires_grad) for t in values))
    inner = [sequence_shard(b, sequence_shards) for b in boundaries[1:-1]]
    return [boundaries[0], *inner, boundaries[-1]]


def _shape_run(block: nn.Module, index: int, values: tuple[torch.Tensor, ...], train: bool) -> object:
    """`block(*values)` on meta tensors; a training micro-batch the block cannot take (BatchNorm over one value per
    channel) is one ConfigError naming the block and the micro-batch size, before any step."""
    try:
        return block(*values)
    except ValueError as err:
        if not train:
            raise
        size = values[0].shape[0] if values and values[0].dim() else "?"
        raise ConfigError(
            f"block {index} ({type(block).__name__}) cannot train on a micro-batch of {size} sample(s): {err}",
            hint="make every micro-batch hold at least 2 samples: a batch size that is a multiple of --chunks "
                 "with batch size / chunks >= 2 (a short last batch too, e.g. drop it), or fewer --chunks",
        ) from None


def check_model_outputs(blocks: Sequence[nn.Module], bounds: Sequence[tuple[int, int]], inputs: Tensors, *,
                        reads: int = 1, last: tuple[torch.Tensor, ...] | None = None) -> None:
    """Raise ConfigError, before any step, if a block returns something that cannot cross a stage or the last
    block returns another number of tensors than the `reads` the loss reads (a meta run of `inputs`, unless
    `last` gives that run's last outputs)."""
    if last is None:
        last = boundary_tensors(blocks, bounds, inputs, train=False)[-1]
    if len(last) != reads:
        index = bounds[-1][1] - 1
        raise ConfigError(
            f"the last block ({index}, {type(blocks[index]).__name__}) returns {len(last)} tensors, "
            f"but the loss reads {'one' if reads == 1 else reads}",
            hint="make the last block return only the tensor the loss compares with the targets" if reads == 1 else
            "pass the loss this model's last block is made for (its outputs, e.g. logits and auxiliary losses)",
        )


class ShapePass:
    """One model's meta blocks and stage bounds, with `boundary_tensors` memoised per input layout and mode.

    An engine builds its schedules (each micro-batch size, training and evaluation, a rebuild after an eviction)
    from the same few passes, each costing tens of times the real forward (meta layer norm and attention run
    torch's Python reference code). The memo belongs to this object, made from one model: a pass is a function
    of these meta blocks (built once, only their train flag set, which the key holds), the bounds, the shards and
    the inputs' shapes, dtypes and strides, so a hit returns what the pass would. Each call returns fresh meta
    tensors (callers may set their flags); at most `capacity` layouts are kept, the least recently used dropped.
    """

    def __init__(self, model: BlockModel, bounds: Sequence[tuple[int, int]], *, sequence_shards: int = 1,
                 capacity: int = 64) -> None:
        self.blocks = meta_blocks(model)
        self.bounds = tuple(bounds)
        self.sequence_shards = sequence_shards
        self.capacity = capacity
        self.passes = 0  #: passes run (memo misses)
        self._memo: OrderedDict[Hashable, list[tuple[torch.Tensor, ...]]] = OrderedDict()

    def boundaries(self, inputs: Tensors, *, train: bool) -> list[tuple[torch.Tensor, ...]]:
        """`boundary_tensors(self.blocks, self.bounds, inputs, ...)`, run once per input layout and `train`."""
        key = (tuple((t.shape, t.dtype, t.layout, t.stride()) for t in as_tuple(inputs)), train)
        found = self._memo.get(key)
        if found is None:
            found = boundary_tensors(self.blocks, self.bounds, inputs, train=train,
                                     sequence_shards=self.sequence_shards)
            self.passes += 1
            while len(self._memo) >= self.capacity:
                self._memo.popitem(last=False)
            self._memo[key] = found
        self._memo.move_to_end(key)
        return [tuple(torch.empty_like(t).requires_grad_(t.requires_grad) for t in b) for b in found]

    def check_outputs(self, inputs: Tensors, *, reads: int = 1) -> None:
        """`check_model_outputs` of this model's stages on `inputs`, its evaluation pass kept for `boundaries`."""
        check_model_outputs(self.blocks, self.bounds, inputs, reads=reads, last=self.boundaries(inputs, train=False)[-1])
