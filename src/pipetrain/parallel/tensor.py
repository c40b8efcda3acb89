"""Tensor parallelism over the mesh's `tp` axis: each block of this rank's stages split by the model's TP plan.

A `BlockModel` says how its blocks split through the optional hook `tp_plan(index, tp, *, sequence_parallel)`,
which returns a `parallelize_module` plan (`{submodule name: ParallelStyle}`) for block `index`, or None for a
block kept whole (replicated on the TP ranks, e.g. an embedding). Plans send plain local tensors out of every
block (`use_local_output=True`), so what crosses a pipeline stage is an ordinary tensor. The hook raises a
`ConfigError` when `tp` does not divide what it splits (heads, hidden size, vocabulary, the sequence).

Under `sequence_parallel` a plan sends, between blocks and so between stages, each floating-point activation of
two or more dimensions as this rank's shard of dimension 1 (the sequence; `[batch, seq / tp, ...]`), and
integer and boolean tensors (masks) whole: the engine sizes the stages' buffers by that rule. The hook is
called with `loss_parallel=True` only when the user asks for the vocabulary-parallel head (`--loss-parallel`):
the last block then returns logits as a DTensor sharded on the vocabulary, and the engine runs its steps under
`loss_parallel()`. Whether a hook takes that keyword is declared (`pipetrain.blocks.tp_plan_hook`, read by
`tp_ability`): a hook that does not is refused with one message, before it is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from pipetrain.blocks import BlockModel, tp_ability
from pipetrain.errors import ConfigError

__all__ = ["TPPlan", "BlockSplit", "block_plans", "check_tensor_parallel", "tensor_parallel_blocks", "check_divides",
           "check_sequence"]

#: What `tp_plan` returns for one block: submodule name (fnmatch pattern) -> style, or None (block kept whole).
TPPlan = dict[str, ParallelStyle] | None


def check_divides(tp: int, what: str, size: int, flag: str) -> None:
    """Raise unless `tp` divides `size` (the `what` of the model: heads, hidden size, vocabulary)."""
    if size % tp:
        divisors = [d for d in range(1, size + 1) if size % d == 0][:8]
        raise ConfigError(f"tp={tp} does not divide the {size} {what} of the model",
                          hint=f"pass {flag} among the divisors of {size} ({', '.join(map(str, divisors))}, ...)")


def check_sequence(tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """Raise when sequence parallelism cannot split the model's `seq_len` over `tp` ranks."""
    if sequence_parallel and seq_len % tp:
        raise ConfigError(f"--sequence-parallel splits each sequence over tp={tp} ranks, but the model's sequence "
                          f"length {seq_len} is not divisible by {tp}",
                          hint=f"pass a --seq-len divisible by {tp}, or drop --sequence-parallel")


def block_plans(model: BlockModel, tp: int, *, sequence_parallel: bool = False,
                loss_parallel: bool = False) -> list[TPPlan]:
    """Every block's plan (raises the model's `ConfigError` when tp does not divide its sizes, and when the
    model has no plan at all, or no vocabulary-parallel head under `loss_parallel`)."""
    ability = tp_ability(model)
    if ability is None:
        raise ConfigError(
            f"the model {type(model).__name__} has no tensor-parallel plan, so --tp {tp} cannot split it",
            hint="run it with --tp 1, or give the BlockModel a tp_plan(index, tp, sequence_parallel) method "
                 "(see docs/tensor-parallel.md)",
        )
    if loss_parallel and not ability.loss_parallel:
        raise ConfigError(f"the model {type(model).__name__} has no vocabulary-parallel head for --loss-parallel",
                          hint="drop --loss-parallel, or accept loss_parallel=True in its tp_plan "
                               "(see docs/tensor-parallel.md)")
    extra = {"loss_parallel": True} if loss_parallel else {}
    plans = [model.tp_plan(index, tp, sequence_parallel=sequence_parallel, **extra)  # type: ignore[attr-defined]
             for index in range(model.num_blocks)]
    if loss_parallel:
        _check_ties_split_alike(model, plans)
    return plans


def _check_ties_split_alike(model: BlockModel, plans: list[TPPlan]) -> None:
    """Raise when a tie's copies (`tied_parameters`) are split by some plans and kept whole by others (a head split
    over the vocabulary tied to an embedding that stays whole): the copies would no longer be one tensor."""
    hook = getattr(model, "tied_parameters", None)
    for group in (hook() if hook is not None else ()):
        split = {any(fnmatch(name.rpartition(".")[0], pattern) for pattern in plans[block] or {})
                 for block, name in group}
        if len(split) > 1:
            raise ConfigError(f"--loss-parallel splits the head over the vocabulary, but the model "
                              f"{type(model).__name__} ties it to its embedding, which its plan keeps whole",
                              hint="drop --loss-parallel, or split the tied embedding over the vocabulary too")


def check_tensor_parallel(model: BlockModel, tp: int, *, sequence_parallel: bool = False,
                          loss_parallel: bool = False) -> None:
    """Raise the one `ConfigError` a TP layout of `model` would meet (no plan, tp not dividing a size); no-op at
    tp == 1. Needs no process group: the CLI calls it before it starts ranks."""
    if tp > 1:
        block_plans(model, tp, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


@dataclass(frozen=True)
class BlockSplit:
    """`(index, block) -> block`: block `index` split over the 1-D `mesh` by its plan. `sequence_shards` is what
    divides dimension 1 of the floating-point tensors between stages (tp under sequence parallelism, else 1);
    `loss_parallel` says whether the last block's logits are vocabulary-sharded DTensors."""

    plans: tuple[TPPlan, ...]
    mesh: DeviceMesh
    sequence_shards: int = 1
    loss_parallel: bool = False

    def __call__(self, index: int, block: nn.Module) -> nn.Module:
        plan = self.plans[index]
        if not plan:
            return block
        block = parallelize_module(block, self.mesh, plan)
        for param in block.parameters():
            if isinstance(param, DTensor) and param.requires_grad:  # a frozen one (LoRA's base) gets no gradient
                param.register_post_accumulate_grad_hook(_grad_as_param)
        return block


def _grad_as_param(param: nn.Parameter) -> None:
    """Lay out a split parameter's replicated gradient as the parameter: torch's backward of a row-parallel
    embedding returns its gradient replicated (every rank the whole table), where the parameter, the tied copies'
    sums (`pipetrain.pipeline.tied`) and the optimizer's state hold this rank's rows (a local slice, no exchange).
    Other gradients (the `Partial` sums of replicated norms under sequence parallelism) are left as they are."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements and \
            all(isinstance(p, Replicate) for p in grad.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def tensor_parallel_blocks(model: BlockModel, mesh: DeviceMesh, *, sequence_parallel: bool = False,
                           loss_parallel: bool = False) -> BlockSplit:
    """The function the engine applies to each block it builds, `(index, block) -> block`, splitting it over
    the 1-D `mesh` (this rank's TP group) by the model's plan."""
    plans = block_plans(model, mesh.size(), sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    return BlockSplit(tuple(plans), mesh, mesh.size() if sequence_parallel else 1, loss_parallel)
