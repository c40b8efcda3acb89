"""The tensor-parallel split of LoRA adapters: the base projection splits by the family's plan, A and B follow.

PEFT's `lora.Linear` computes `base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`. Under a column-parallel base
(each rank computes its output columns), B is split the same way (its output rows: `ColwiseParallel`, or the
strided split of a fused `[q | k | v]` projection, `FusedColwiseParallel(parts)`) and A is whole on every rank,
taking a plain local input (its gradient is then the all-reduced gradient that B's input receives). Under a
row-parallel base (each rank holds input columns and the outputs are all-reduced), A is split by its input
columns with the base's style and B is whole, its input and gradient the same on every rank. Every other entry of
the plan is kept.
"""

from __future__ import annotations

import copy

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from pipetrain.compat.tensor_styles import Conv1DParallel, FusedColwiseParallel
from pipetrain.errors import ConfigError
from pipetrain.lora.config import ADAPTER_NAME as ADAPTER
from pipetrain.parallel.tensor import TPPlan

__all__ = ["lora_tp_plan"]


def _whole_input() -> PrepareModuleInput:
    """A module kept whole on every TP rank that takes a plain local (replicated) tensor, whatever it is given."""
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=True)


def _adapter_styles(style: ParallelStyle, name: str) -> dict[str, ParallelStyle]:
    """The styles of `name`'s base layer, A and B for the base style `style`."""
    a, b = f"{name}.lora_A.{ADAPTER}", f"{name}.lora_B.{ADAPTER}"
    if isinstance(style, Conv1DParallel):
        if style.kind == "colwise":
            split = FusedColwiseParallel(style.parts) if style.parts > 1 else ColwiseParallel()
            return {f"{name}.base_layer": style, a: _whole_input(), b: split}
        return {f"{name}.base_layer": style, a: RowwiseParallel()}
    if isinstance(style, ColwiseParallel):  # FusedColwiseParallel too: B's rows split as the base's
        return {f"{name}.base_layer": style, a: _whole_input(), b: copy.deepcopy(style)}
    if isinstance(style, RowwiseParallel):
        return {f"{name}.base_layer": style, a: copy.deepcopy(style)}
    raise ConfigError(f"LoRA on {name!r}: its tensor-parallel style {type(style).__name__} has no adapter split",
                      hint="leave this module out of --lora-targets, or run with --tp 1")


def lora_tp_plan(plan: TPPlan, adapted: list[str]) -> TPPlan:
    """`plan` (a block's `{submodule: style}`) with each module of `adapted` (those carrying an adapter) split as
    its base layer and adapters; an adapted module the plan leaves whole stays whole (its adapters too)."""
    if plan is None:
        return None
    out: dict[str, ParallelStyle] = {}
    for name, style in plan.items():
        out.update(_adapter_styles(style, name) if name in adapted else {name: style})
    return out
