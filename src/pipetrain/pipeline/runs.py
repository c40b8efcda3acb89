"""How one batch is cut into schedule runs: pure data, no processes (torch 2.13 needs equal micro-batches)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Run", "plan_runs"]


@dataclass(frozen=True)
class Run:
    """One call of a schedule: `count` micro-batches of `size` samples; `fallback` runs GPipe-style."""

    count: int
    size: int
    fallback: bool = False

    @property
    def samples(self) -> int:
        return self.count * self.size


def plan_runs(batch_size: int, chunks: int) -> list[Run]:
    """Cut `batch_size` samples into runs of equal micro-batches, in order.

    torch's schedules size their buffers from the first micro-batch and break on any other shape, so a
    batch that `chunks` does not divide becomes `chunks` equal micro-batches plus one remainder
    micro-batch, run as a second (GPipe-style) schedule call; a batch smaller than `chunks` is run as
    one GPipe-style call of single-sample micro-batches. Gradients are identical: the engine weights each
    micro-batch's mean loss by its share of the batch.
    """
    if batch_size < 1 or chunks < 1:
        raise ValueError(f"batch_size and chunks must be positive, got {batch_size} and {chunks}")
    size, remainder = divmod(batch_size, chunks)
    if size == 0:
        return [Run(count=batch_size, size=1, fallback=True)]
    runs = [Run(count=chunks, size=size)]
    if remainder:
        runs.append(Run(count=1, size=remainder, fallback=True))
    return runs
