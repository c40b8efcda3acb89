"""Successive halving over candidate layouts: measure all briefly, keep the faster half, measure longer.

Pure: the measurement is a callable `measure(candidate, steps) -> seconds per step or None (failed)`, so
this is tested without processes. Round r measures each survivor for `first_steps * 2**r` timed steps
(plus `warmup` untimed ones, which count in the cost); the faster half (at least one) survives; a
candidate that fails (out of memory, error) is dropped. Cost is counted in cell-steps (warm-up included),
the unit of `pipetrain bench`'s grid cost.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["Trial", "HalvingResult", "successive_halving"]


@dataclass(frozen=True)
class Trial:
    """One measurement: candidate `index` timed over `steps` steps (None: it failed)."""

    index: int
    steps: int
    step_s: float | None


@dataclass
class HalvingResult:
    """The winner's index and its last measured step time, every trial, and the cost in cell-steps."""

    best: int
    best_step_s: float
    trials: list[Trial] = field(default_factory=list)
    cell_steps: int = 0


def successive_halving(candidates: Sequence[Hashable], measure: Callable[[Hashable, int], float | None], *,
                       first_steps: int = 1, warmup: int = 1) -> HalvingResult:
    """Run the rounds until one candidate is left (see the module docstring)."""
    if not candidates:
        raise ValueError("no candidate to measure")
    alive = list(range(len(candidates)))
    trials: list[Trial] = []
    cost, steps, last = 0, first_steps, {}
    while True:
        timed = []
        for index in alive:
            step_s = measure(candidates[index], steps)
            cost += warmup + steps
            trials.append(Trial(index, steps, step_s))
            if step_s is not None:
                timed.append((step_s, index))
                last[index] = step_s
        if not timed:
            raise RuntimeError("every candidate failed to run")
        timed.sort()
        alive = [index for _, index in timed[: max(1, len(timed) // 2)]]
        if len(alive) == 1:
            return HalvingResult(best=alive[0], best_step_s=last[alive[0]], trials=trials, cell_steps=cost)
        steps *= 2
