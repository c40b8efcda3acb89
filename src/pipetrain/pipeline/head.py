"""The last stage's loss computed inside its forward, so the stage's output (a language model's logits) dies there.

torch's `PipelineStage` keeps what a stage's forward returns (`fwd_cache`) until that micro-batch's backward. Were
the last stage to return its logits, they would live from its forward to its backward, beside the log-softmax the
cross-entropy saves: two logits-sized tensors per micro-batch in flight. With a `LossHead` the last stage's forward
returns the micro-batch's weighted loss (a scalar): the schedule keeps that, its "loss function" passes it on
(`passed_on`), and the logits are freed once the loss (and the step's metrics, summed by the engine's loss function)
is computed; only the tensors the loss saves for its backward stay (the cross-entropy's log-softmax).

The loss runs as it ran after the stage before: outside autocast, on the outputs autocast made low-precision cast to
fp32 (what `AutocastStage` returns), outside the stage's recomputation and activation offloading. A training run
arms the head (`RecomputeWrapper.head`); forward-only runs (evaluation, reference log-probabilities, generation)
leave it unarmed and get the outputs. When the caller reads a training step's outputs (`PipelineEngine.keep_outputs`)
the head keeps each micro-batch's outputs, detached, for the step's result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pipetrain.blocks import Tensors
from pipetrain.pipeline.precision import to_fp32

__all__ = ["LossHead", "armed", "passed_on"]


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return tuple(_detached(v) for v in value) if isinstance(value, tuple) else value


class LossHead:
    """The loss `loss_fn(outputs, target)` of each micro-batch of a run, in micro-batch order (a stage runs its
    forwards in order, as `RecomputeWrapper` relies on too), `targets` the run's targets cut as the schedule cuts
    them (`tensor_split` in `count` micro-batches). With `keep`, `outputs` collects each micro-batch's outputs."""

    def __init__(self, loss_fn: Callable[[Tensors, torch.Tensor], torch.Tensor], targets: torch.Tensor, count: int,
                 *, keep: bool = False) -> None:
        self._loss_fn = loss_fn
        self._targets: Sequence[torch.Tensor] = targets.tensor_split(count)
        self._calls = 0
        self.keep = keep
        self.outputs: list[Tensors] = []

    def __call__(self, output: Tensors) -> torch.Tensor:
        if self._calls >= len(self._targets):
            raise RuntimeError(f"the last stage ran {self._calls + 1} forwards in a run of {len(self._targets)} "
                               "micro-batches")
        target = self._targets[self._calls]
        self._calls += 1
        device = (output[0] if isinstance(output, tuple) else output).device.type
        if torch.is_autocast_enabled(device):  # the stage's outputs as `AutocastStage` returns them
            output = to_fp32(output, torch.get_autocast_dtype(device))
        if self.keep:
            self.outputs.append(_detached(output))
        with torch.autocast(device, enabled=False):
            return self._loss_fn(output, target)


def passed_on(output: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss function under a `LossHead`: the last stage's output is already the loss."""
    return output


@contextmanager
def armed(wrapper: Any, head: LossHead | None) -> Iterator[LossHead | None]:
    """`wrapper` (the last stage's `RecomputeWrapper`) computing `head`'s loss in its forward for the block's length
    (nothing when `head` is None)."""
    if head is None:
        yield None
        return
    wrapper.head = head
    try:
        yield head
    finally:
        wrapper.head = None
