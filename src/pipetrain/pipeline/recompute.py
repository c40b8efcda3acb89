"""Activation recomputation per micro-batch, with the semantics of the old `torch.distributed.pipeline.sync.Pipe`,
of the whole stage, of every (K-th) block, or selective (torch's op-level checkpoint policies)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pipetrain.blocks import as_tuple
from pipetrain.pipeline.offload import ActivationOffload

__all__ = ["recomputes", "recomputed_blocks", "RecomputeWrapper", "SAVED_OPS", "MATMUL_OPS", "selective_policy",
           "is_recomputing"]

_state = threading.local()


def is_recomputing() -> bool:
    """Whether the forward running in this thread is a recomputation (activation checkpointing's second forward):
    a block that counts what passes through it (a router's tokens per expert) counts only the first one."""
    return getattr(_state, "depth", 0) > 0


class _Recomputing:
    """The flag `is_recomputing` reads, raised inside; reusable (a split backward recomputes once per half)."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _state.depth -= 1


def _ops(*names: str) -> tuple[Any, ...]:
    """The aten overload packets of `names` this torch has (the attention kernels differ between builds)."""
    return tuple(getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name))


#: what selective recomputation keeps (torchtitan's list, less its Float8 and collective entries): the outputs of
#: matrix products and attention; everything else (norms, activations, elementwise, dropout) is recomputed
SAVED_OPS = frozenset(
    op.default for op in _ops(
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    ))


#: the matrix products among `SAVED_OPS`, which the "alternate" policy counts
MATMUL_OPS = frozenset(op.default for op in _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm"))


def _keep_expensive(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_policy(matmuls: str = "all") -> Callable[..., CheckpointPolicy]:
    """A policy for one checkpointed forward (`create_selective_checkpoint_contexts`): keep `SAVED_OPS`' outputs
    (`matmuls` "all"), or all but every second matrix product in the forward's order ("alternate": the 1st, 3rd,
    ... kept; torchtitan's op-level policy). torch asks the policy in the first forward only (the recomputation
    reads the kept outputs back in order), so one count per checkpointed forward decides."""
    if matmuls == "all":
        return _keep_expensive
    seen = [0]  # matrix products so far in this forward

    def keep_alternate(ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        if op in MATMUL_OPS:
            seen[0] += 1
            if seen[0] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _keep_expensive(ctx, op)

    return keep_alternate


def recomputes(policy: str, index: int, count: int) -> bool:
    """Whether micro-batch `index` of `count` drops its activations and recomputes them in backward.

    `never`: none; `always`: all; `except_last`: all but the last (so a single micro-batch recomputes nothing),
    because the last micro-batch's backward starts right after its forward and would gain nothing.
    """
    if policy == "always":
        return True
    if policy == "except_last":
        return index < count - 1
    return False


def recomputed_blocks(first: int, count: int, every: int) -> list[int]:
    """The positions in a stage of blocks `first`, ..., `first + count - 1` (model indices) that a per-block unit
    recomputes: every `every`-th block of the model, counted from 1 (torchtitan's layer-level frequency)."""
    return [i for i in range(count) if (first + i + 1) % every == 0]


class _Both:
    """Several contexts entered as one, in order, left in reverse (what `context_fn` returns for each forward);
    reusable when they are (a split backward recomputes once per half)."""

    def __init__(self, *contexts: AbstractContextManager[Any]) -> None:
        self.contexts = contexts

    def __enter__(self) -> None:
        for context in self.contexts:
            context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for context in reversed(self.contexts):
            context.__exit__(*exc)


class RecomputeWrapper(nn.Module):
    """Runs the wrapped stage module under `checkpoint` for the micro-batches the policy selects.

    `unit` (`PipelineConfig.recompute_unit`): "stage" checkpoints the whole stage (keeping its input); "layer" each
    block of `recomputed_blocks` (keeping every block's input); "selective" those blocks under torch's selective
    policy (`SAVED_OPS` kept, or with `matmuls` "alternate" every other matrix product among them; the rest
    recomputed), except the model's last block when the stage holds it (`head`): there the policy would keep the
    output of its last matrix product, a language model's logits, to the backward (as torchtitan, whose selective
    checkpoint wraps the transformer blocks only, the head runs plain: it keeps its input). `first_block` is the
    model index of the stage's first block.
    `offload` (see `pipeline.offload`) moves the saved activations of micro-batches waiting for their backward to
    host memory. The engine calls `start_step(count)` before each step; forwards then arrive in micro-batch order
    (true of every pipeline schedule: a stage runs its forwards in order). `recompute_context` (e.g.
    `pipetrain.batchnorm.StageNorms.recomputing`) makes the context the recomputed forward runs in (the first forward
    runs as without it): there, BatchNorm layers must not update their running statistics a second time. `head`:
    see `pipeline.head`.
    """

    def __init__(self, module: nn.Module, policy: str,
                 recompute_context: Callable[[], AbstractContextManager[Any]] | None = None, *,
                 unit: str = "stage", every: int = 1, first_block: int = 0, head: bool = False,
                 offload: ActivationOffload | None = None, matmuls: str = "all") -> None:
        super().__init__()
        self.module = module
        self.policy = policy
        self.unit = unit
        self.matmuls = matmuls
        self._recompute_context = recompute_context or nullcontext
        self._blocks = [] if unit == "stage" else recomputed_blocks(first_block, len(module), every)
        if unit == "selective" and head:
            self._blocks = [i for i in self._blocks if i != len(module) - 1]
        self.offload = offload
        self._count = 1
        self._calls = 0
        #: the last stage's loss in a training run (`pipeline.head.LossHead`, armed by the engine): the forward
        #: returns `head(outputs)`, so the schedule keeps the loss for the backward, not the outputs
        self.head: Callable[[Any], Any] | None = None

    @property
    def recompute_modules(self) -> list[nn.Module]:
        """The modules whose forwards a recomputing micro-batch runs again in its backward (what the trace times)."""
        return [self.module] if self.unit == "stage" else [self.module[i] for i in self._blocks]

    def start_step(self, count: int) -> None:
        """Reset the micro-batch counter for a step of `count` micro-batches."""
        self._count = count
        self._calls = 0
        if self.offload is not None:
            self.offload.start_step(count)

    def forward(self, *args: Any) -> Any:
        index = self._calls
        self._calls += 1
        offloading = self.offload.saving(index) if self.offload is not None and self.training else nullcontext()
        with offloading:
            out = self._run(index, args)
        # the last stage's loss (outside recomputation and offloading): the stage returns it, the outputs die here
        return out if self.head is None else self.head(out)

    def _run(self, index: int, args: tuple[Any, ...]) -> Any:
        if not (self.training and recomputes(self.policy, index, self._count)):
            return self.module(*args)
        if self.unit == "stage":
            return checkpoint(self.module, *args, use_reentrant=False, context_fn=self._contexts)
        values: Any = args
        chosen = set(self._blocks)
        for i, block in enumerate(self.module):
            if i in chosen:
                values = checkpoint(block, *as_tuple(values), use_reentrant=False, context_fn=self._contexts)
            else:
                values = block(*as_tuple(values))
        return values

    def _contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        """(the first forward's context, the recomputed forward's): `torch.utils.checkpoint`'s `context_fn`."""
        if self.unit == "selective":
            first, again = create_selective_checkpoint_contexts(selective_policy(self.matmuls))
            return first, _Both(again, self._recompute_context(), _Recomputing())
        return nullcontext(), _Both(self._recompute_context(), _Recomputing())
