"""Splitting a model's blocks into pipeline stages: solvers (pure), costs and profiles.

`balance_bounds`, `solve_balance` and `uniform_balance` are pure; `cost_balance`, `parameter_costs` and
`resolve_balance` build blocks with torch, so they load on first use.
"""

from __future__ import annotations

from typing import Any

from pipetrain.partition.solver import balance_bounds, solve_balance, uniform_balance

__all__ = ["balance_bounds", "cost_balance", "parameter_costs", "resolve_balance", "solve_balance", "uniform_balance"]


def __getattr__(name: str) -> Any:
    if name in ("cost_balance", "parameter_costs", "resolve_balance"):
        from pipetrain.partition import cost

        return getattr(cost, name)
    raise AttributeError(f"module 'pipetrain.partition' has no attribute {name!r}")
