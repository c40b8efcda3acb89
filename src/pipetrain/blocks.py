"""A model as an ordered list of blocks that each rank can build one at a time (never the whole model)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

__all__ = [
    "BlockModel",
    "BlockSequential",
    "ModuleListModel",
    "TPAbility",
    "Tensors",
    "as_tuple",
    "build_blocks",
    "build_sequential",
    "block_seed",
    "tp_ability",
    "tp_plan_hook",
]

#: What a block takes and returns: one tensor, or a tuple of tensors.
Tensors = torch.Tensor | tuple[torch.Tensor, ...]


@runtime_checkable
class BlockModel(Protocol):
    """What pipetrain needs from a model: how many blocks, how to build block `i`, and a sample input.

    Several tensors may flow between blocks: a block is called as `block(*tensors)` and returns one tensor
    or a tuple of tensors, which the next block receives positionally, whether it runs on the same stage
    or on the next one (e.g. `(hidden, padding_mask)` -> `(hidden, padding_mask)`). The first block receives
    the batch's input(s) the same way (a tuple of inputs is several arguments). Integer and boolean tensors
    (masks, positions) cross stages without gradients; float tensors carry gradients when they depend on
    parameters. Every tensor's first dimension is the batch (micro-batches are cut along it). The last
    block returns the one tensor the loss reads (or as many as the loss's `outputs` says, see `pipeline.loss.Loss`). Only tensors cross a stage: a block returning anything
    else (a Python number, None, a dict) is refused with an error naming it.

    Optional hook: `tied_parameters()` returns groups of `(block index, name in block)` that are one tensor
    of the unsplit model (an input embedding tied to the output head); each block holds a copy, and the
    engine keeps the copies equal (see `pipetrain.pipeline.tied`); a checkpoint stores the first one.

    Optional hook: `tp_plan(index, tp, *, sequence_parallel=False)` returns block `index`'s tensor-parallel plan,
    `{submodule name: ParallelStyle}` for `parallelize_module` (None: the block is kept whole on every TP rank),
    and raises `ConfigError` when `tp` does not divide what it splits; `--tp` needs it (see
    `pipetrain.parallel.tensor` and docs/tensor-parallel.md). Decorated with `@tp_plan_hook(loss_parallel=True)`,
    it declares that it also answers `loss_parallel=True` (`--loss-parallel`), see `TPAbility`.
    """

    @property
    def num_blocks(self) -> int:
        """Number of blocks in order; stages are contiguous runs of them."""
        ...

    def build_block(self, index: int) -> nn.Module:
        """Build block `index` (on the current default device; may be the meta device)."""
        ...

    def example_input(self, batch_size: int) -> Tensors:
        """The first block's input(s) for `batch_size` samples: one tensor or a tuple (values may be garbage;
        only shapes and dtypes count)."""
        ...


@dataclass(frozen=True)
class TPAbility:
    """What a model's `tp_plan` hook declares beyond splitting blocks: `loss_parallel`, whether it takes
    `loss_parallel=True` (and returns a vocabulary-parallel head, or raises a `ConfigError` saying why not)."""

    loss_parallel: bool = False


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def tp_plan_hook(*, loss_parallel: bool = False) -> Callable[[_Hook], _Hook]:
    """Declare what the decorated `tp_plan` method supports: `@tp_plan_hook(loss_parallel=True)`. The declaration
    belongs to that method: a subclass overriding `tp_plan` declares again (or is read from its signature)."""

    def declare(hook: _Hook) -> _Hook:
        hook.tp_ability = TPAbility(loss_parallel=loss_parallel)  # type: ignore[attr-defined]
        return hook

    return declare


def tp_ability(model: object) -> TPAbility | None:
    """What `model`'s `tp_plan` hook supports, None without a hook. A hook not declared with `tp_plan_hook` (written
    before declarations) takes `loss_parallel` when its signature names it or takes `**kwargs`."""
    hook = getattr(model, "tp_plan", None)
    if hook is None:
        return None
    declared = getattr(hook, "tp_ability", None)
    if isinstance(declared, TPAbility):
        return declared
    parameters = inspect.signature(hook).parameters.values()
    return TPAbility(loss_parallel=any(p.name == "loss_parallel" or p.kind is p.VAR_KEYWORD for p in parameters))


def as_tuple(value: Tensors) -> tuple[torch.Tensor, ...]:
    """`value` as a tuple of tensors (a single tensor becomes a 1-tuple)."""
    return value if isinstance(value, tuple) else (value,)


class BlockSequential(nn.Sequential):
    """`nn.Sequential` that passes tuples between blocks positionally (`block(*tensors)`), see `BlockModel`.

    With one tensor between blocks it computes exactly what `nn.Sequential` does; parameter names are the
    same (`<index>.<name in block>`).
    """

    def forward(self, *inputs: torch.Tensor) -> Tensors:
        values: Tensors = inputs
        for block in self:
            values = block(*as_tuple(values))
        return values


class ModuleListModel:
    """Adapts an existing `nn.Sequential` (or list of modules) to `BlockModel`; each block is deep-copied.

    Convenient for small models; for a model larger than one device, write a `BlockModel` whose
    `build_block` constructs only the requested block.
    """

    def __init__(self, modules: Sequence[nn.Module] | nn.Sequential, example_input: Tensors) -> None:
        self._modules = list(modules)
        self._example = example_input

    @property
    def num_blocks(self) -> int:
        return len(self._modules)

    def build_block(self, index: int) -> nn.Module:
        return copy.deepcopy(self._modules[index])

    def example_input(self, batch_size: int) -> Tensors:
        def repeat(example: torch.Tensor) -> torch.Tensor:
            reps = [1] * example.dim()
            reps[0] = -(-batch_size // example.shape[0])
            return example.repeat(*reps)[:batch_size]

        if isinstance(self._example, tuple):
            return tuple(repeat(example) for example in self._example)
        return repeat(self._example)


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


def build_sequential(model: BlockModel, *, seed: int, device: torch.device | str = "cpu") -> BlockSequential:
    """The whole model on one device: the single-process reference the pipelined runs must match.

    Call it like the first block: `model(*inputs)` when `example_input` is a tuple. Weights the model ties
    (`tied_parameters()`) are one parameter here, as in the unsplit model: each copy after the first is replaced
    by the first (its gradient sums every use; `named_parameters(remove_duplicate=False)` names every copy).
    """
    net = BlockSequential(*build_blocks(model, range(model.num_blocks), seed=seed, device=device))
    hook = getattr(model, "tied_parameters", None)
    for (first_block, first_name), *others in (hook() if hook is not None else ()):
        shared = net[first_block].get_parameter(first_name)
        for block, name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(net[block].get_submodule(owner), leaf, shared)
    return net
