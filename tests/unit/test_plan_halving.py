"""Successive halving: the faster half survives, steps double, failures drop out, the cost is counted."""

from __future__ import annotations

import pytest

from pipetrain.plan.halving import successive_halving


def test_halving_keeps_the_fastest_and_counts_cell_steps():
    speeds = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 4.0}
    calls = []

    def measure(name, steps):
        calls.append((name, steps))
        return speeds[name]

    result = successive_halving(list(speeds), measure, first_steps=1, warmup=1)
    assert result.best == 1 and result.best_step_s == 1.0
    assert calls == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("b", 2), ("c", 2)]
    assert result.cell_steps == 4 * (1 + 1) + 2 * (1 + 2)


def test_failed_candidates_are_dropped():
    result = successive_halving(["oom", "ok"], lambda name, steps: None if name == "oom" else 0.5)
    assert result.best == 1 and result.cell_steps == 4
    with pytest.raises(RuntimeError):
        successive_halving(["oom"], lambda name, steps: None)
    with pytest.raises(ValueError):
        successive_halving([], lambda name, steps: 1.0)
