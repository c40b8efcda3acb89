"""Regional compilation: `torch.compile` applied to each block of a stage (`--compile`), never to the whole stage.

One block at a time, as torchtitan compiles each transformer block: the blocks of a stage that share their code
(every encoder layer) share one compiled graph, so compile time does not grow with depth; the stage module, its
recomputation wrapper and the data-parallel wrapper stay eager, so the pipeline schedule, activation
checkpointing (`--checkpoint`, non-reentrant, around compiled blocks) and DDP/FSDP hooks run as without
`--compile`. `nn.Module.compile` compiles in place: parameter names (and so checkpoint keys and tied-weight
names) are those of the eager block, with no `_orig_mod.` prefix.

Shapes: `dynamic=None` is torch's automatic dynamic shapes (one graph for the first shape; a dimension seen
with a second size is made symbolic, one recompilation); `dynamic=True` makes every dimension symbolic from the
start, what sequence lengths that vary batch by batch (`--bucket`) need so as not to recompile per length and
hit dynamo's recompilation limit (past which a block silently runs eager).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from torch import nn

from pipetrain.config import ParallelConfig

__all__ = ["compile_blocks", "dynamic_shapes"]


def compile_blocks(blocks: Iterable[nn.Module], *, dynamic: bool | None = None) -> None:
    """Compile each block in place with `torch.compile` (inductor, the default backend; `dynamic` as above).

    Compilation itself happens on each block's first call (the first steps); on CPU, inductor writes C++ and
    builds it with the machine's C++ compiler and the Python headers.
    """
    for block in blocks:
        block.compile(dynamic=dynamic)


def dynamic_shapes(parallel: ParallelConfig) -> ParallelConfig:
    """`parallel` compiling with every dimension symbolic (`compile_dynamic=True`) unless set otherwise: for jobs
    whose sequence lengths vary from batch to batch (bucketed batches)."""
    pipeline = parallel.pipeline
    if pipeline.compile_dynamic is not None:
        return parallel
    return replace(parallel, pipeline=replace(pipeline, compile_dynamic=True))
