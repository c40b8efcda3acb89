"""Activation recomputation per micro-batch, with the semantics of the old `torch.distributed.pipeline.sync.Pipe`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["recomputes", "RecomputeWrapper", "is_recomputing"]

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


class RecomputeWrapper(nn.Module):
    """Runs the wrapped stage module under `checkpoint` for the micro-batches the policy selects.

    The engine calls `start_step(count)` before each step; forwards then arrive in micro-batch order
    (true of every pipeline schedule: a stage runs its forwards in order). `recompute_context` (e.g.
    `pipetrain.batchnorm.StageNorms.recomputing`) makes the context the recomputed forward runs in (the first forward
    runs as without it): there, BatchNorm layers must not update their running statistics a second time.
    """

    def __init__(self, module: nn.Module, policy: str,
                 recompute_context: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        super().__init__()
        self.module = module
        self.policy = policy
        self._recompute_context = recompute_context or nullcontext
        self._count = 1
        self._calls = 0

    def start_step(self, count: int) -> None:
        """Reset the micro-batch counter for a step of `count` micro-batches."""
        self._count = count
        self._calls = 0

    def forward(self, *args: Any) -> Any:
        index = self._calls
        self._calls += 1
        if self.training and recomputes(self.policy, index, self._count):
            return checkpoint(self.module, *args, use_reentrant=False, context_fn=self._contexts)
        return self.module(*args)

    def _contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        """(the first forward's context, the recomputed forward's): `torch.utils.checkpoint`'s `context_fn`."""
        return nullcontext(), _Both(self._recompute_context(), _Recomputing())


class _Both:
    """Two contexts entered as one (what `context_fn` may return for each forward), the first entered first."""

    def __init__(self, first: AbstractContextManager[Any], second: AbstractContextManager[Any]) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)
