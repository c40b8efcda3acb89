"""Partitioning: which contiguous blocks of a model each pipeline stage holds."""

from pipetrain.partition.cost import cost_balance, parameter_costs, resolve_balance
from pipetrain.partition.solver import balance_bounds, solve_balance, uniform_balance

__all__ = ["balance_bounds", "cost_balance", "parameter_costs", "resolve_balance", "solve_balance", "uniform_balance"]
