"""Tensor parallelism over the mesh's `tp` axis: each block of this rank's stages split by the model's TP plan.

A `BlockModel` says how its blocks split through the optional hook `tp_plan(index, tp, sequence_parallel)`,
which returns a `parallelize_module` plan (`{submodule name: ParallelStyle}`) for block `index`, or None for a
block kept whole (replicated on the TP ranks, e.g. an embedding). Plans send plain local tensors out of every
block (`use_local_output=True`), so what crosses a pipeline stage is an ordinary tensor. The hook raises a
`ConfigError` when `tp` does not divide what it splits (heads, hidden size, vocabulary).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from pipetrain.blocks import BlockModel
from pipetrain.errors import ConfigError

__all__ = ["TPPlan", "block_plans", "check_tensor_parallel", "tensor_parallel_blocks"]

#: What `tp_plan` returns for one block: submodule name (fnmatch pattern) -> style, or None (block kept whole).
TPPlan = dict[str, ParallelStyle] | None


def block_plans(model: BlockModel, tp: int, *, sequence_parallel: bool = False) -> list[TPPlan]:
    """Every block's plan (raises the model's `ConfigError` when tp does not divide its sizes, and when the
    model has no plan at all)."""
    hook = getattr(model, "tp_plan", None)
    if hook is None:
        raise ConfigError(
            f"the model {type(model).__name__} has no tensor-parallel plan, so --tp {tp} cannot split it",
            hint="run it with --tp 1, or give the BlockModel a tp_plan(index, tp, sequence_parallel) method "
                 "(see docs/tensor-parallel.md)",
        )
    return [hook(index, tp, sequence_parallel=sequence_parallel) for index in range(model.num_blocks)]


def check_tensor_parallel(model: BlockModel, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise the one `ConfigError` a TP layout of `model` would meet (no plan, tp not dividing a size); no-op at
    tp == 1. Needs no process group: the CLI calls it before it starts ranks."""
    if tp > 1:
        block_plans(model, tp, sequence_parallel=sequence_parallel)


def tensor_parallel_blocks(model: BlockModel, mesh: DeviceMesh, *, sequence_parallel: bool = False
                           ) -> Callable[[int, nn.Module], nn.Module]:
    """The function the engine applies to each block it builds, `(index, block) -> block`, splitting it over
    the 1-D `mesh` (this rank's TP group) by the model's plan."""
    plans = block_plans(model, mesh.size(), sequence_parallel=sequence_parallel)

    def split(index: int, block: nn.Module) -> nn.Module:
        plan = plans[index]
        return parallelize_module(block, mesh, plan) if plan else block

    return split
