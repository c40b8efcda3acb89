"""Regional compilation: `torch.compile` applied to each block of a stage (`--compile`), never to the whole stage.

One block at a time, as torchtitan compiles each transformer block: the blocks of a stage that share their class
(every encoder layer) share one compiled graph, so compile time does not grow with depth; the stage module, its
recomputation wrapper and the data-parallel wrapper stay eager, so the pipeline schedule, activation
checkpointing (`--checkpoint`, non-reentrant, around compiled blocks) and DDP/FSDP hooks run as without
`--compile`. A block is compiled in place (its `forward` replaced): parameter names, and so checkpoint keys and
tied-weight names, are those of the eager block, with no `_orig_mod.` prefix.

Why not `block.compile()`: torch 2.13's dynamo skips the frames of torch's own files, so `nn.Module.compile` on a
block that is a torch module (`nn.TransformerEncoderLayer`, the classifier's layers) compiles nothing, silently.
The compiled entry here is a function of this file, which dynamo traces, inlining the block's forward; one entry
(one code object) per block class, as dynamo's recompilation limit counts per code object.

Shapes: `dynamic=None` is torch's automatic dynamic shapes (one graph for the first shape; a dimension seen
with a second size is made symbolic, one recompilation); `dynamic=True` makes every dimension symbolic from the
start, what sequence lengths that vary batch by batch (`--bucket`) need so as not to recompile per length and
reach the recompilation limit (past which a block silently runs eager).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pipetrain.config import ParallelConfig

__all__ = ["compile_blocks", "dynamic_shapes", "is_compiled"]


def _run(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


@functools.cache
def _entry(block_class: type, dynamic: bool | None) -> Callable[..., Any]:
    """The compiled entry of one block class: `_run` under its own code object (its own dynamo cache)."""
    name = f"compiled_{block_class.__name__}"
    code = _run.__code__.replace(co_name=name, co_qualname=name)
    return torch.compile(types.FunctionType(code, _run.__globals__, name), dynamic=dynamic)


def compile_blocks(blocks: Iterable[nn.Module], *, dynamic: bool | None = None) -> None:
    """Compile each block in place with `torch.compile` (inductor, the default backend; `dynamic` as above).

    Compilation itself happens on each block's first calls (the first steps, and the first forward-only pass);
    on CPU, inductor writes C++ and builds it with the machine's C++ compiler against the Python headers.
    """
    for block in blocks:
        block.forward = functools.partial(_entry(type(block), dynamic), block.forward)


def is_compiled(block: nn.Module) -> bool:
    """Whether `compile_blocks` compiled `block`."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, functools.partial) and getattr(forward.func, "__wrapped__", None) is not None


def dynamic_shapes(parallel: ParallelConfig) -> ParallelConfig:
    """`parallel` compiling with every dimension symbolic (`compile_dynamic=True`) unless set otherwise: for jobs
    whose sequence lengths vary from batch to batch (bucketed batches)."""
    pipeline = parallel.pipeline
    if pipeline.compile_dynamic is not None:
        return parallel
    return replace(parallel, pipeline=replace(pipeline, compile_dynamic=True))
