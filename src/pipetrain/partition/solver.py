"""The pure partition solver: per-block costs in, a contiguous balance (block counts per stage) out.

No torch here: costs are plain numbers, so the solver is tested as plain data.

`solve_balance` is exact. It minimises the cost of the heaviest part and, beyond that, the whole
sorted profile of part costs ("leximax": among splits with the same heaviest part, the second heaviest
is as light as possible, and so on). Splits that are still tied are decided, in this order, by:

1. the most even block counts (same leximax rule applied to the counts), then
2. earlier parts heavier (the first part's cost as large as possible, then the second's, ...), then
3. earlier parts longer (more blocks first).

Rules 2 and 3 follow `uniform_balance`, which puts the larger counts first: with equal block costs
both methods return the same balance. Costs are first turned exactly into integers (every finite float
is an integer times a power of two), so part costs are summed and compared without rounding.
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Sequence

from pipetrain.errors import ConfigError

__all__ = ["solve_balance", "uniform_balance", "balance_bounds"]


def _check_parts(num_blocks: int, parts: int) -> None:
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ConfigError(
            f"cannot split {num_blocks} blocks into {parts!r} parts",
            hint="ask for at least 1 part (stage)",
        )
    if parts > num_blocks:
        raise ConfigError(
            f"cannot split {num_blocks} blocks into {parts} parts: every part needs at least one block",
            hint=f"use at most {num_blocks} parts (stages), or a model with at least {parts} blocks",
        )


def uniform_balance(num_blocks: int, parts: int) -> list[int]:
    """Split `num_blocks` into `parts` counts that differ by at most one, the larger counts first."""
    _check_parts(num_blocks, parts)
    size, extra = divmod(num_blocks, parts)
    return [size + 1] * extra + [size] * (parts - extra)


def balance_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """The `[start, stop)` block range of each part of `balance`, e.g. `[2, 3] -> [(0, 2), (2, 5)]`."""
    bounds = []
    start = 0
    for count in balance:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(
                f"balance {list(balance)} has a part with {count!r} blocks",
                hint="every part needs a whole number of blocks, at least 1",
            )
        bounds.append((start, start + count))
        start += count
    return bounds


def _exact_integers(costs: Sequence[float]) -> list[int]:
    """`costs` multiplied by one common power of two into exact integers (order and ties preserved)."""
    ratios = []
    for index, cost in enumerate(costs):
        try:
            value = cost if isinstance(cost, int) and not isinstance(cost, bool) else float(cost)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"block {index} has cost {cost!r}",
                hint="block costs must be finite numbers >= 0",
            )
        ratios.append(value.as_integer_ratio())  # the denominator is a power of two
    scale = max((denominator for _, denominator in ratios), default=1)
    return [numerator * (scale // denominator) for numerator, denominator in ratios]


def _min_bottleneck(weight: list[list[int]], n: int, parts: int) -> int:
    """The smallest achievable cost of the heaviest part (plain min-max dynamic programming)."""
    unreachable = weight[0][n] + 1  # more than the whole model costs
    best = [unreachable] * (n + 1)
    best[0] = 0
    for p in range(1, parts + 1):
        new = [unreachable] * (n + 1)
        for stop in range(p, n - (parts - p) + 1):
            new[stop] = min(max(best[start], weight[start][stop]) for start in range(p - 1, stop))
        best = new
    return best[n]


# A partial solution's sort key: (leximax costs, leximax counts, in-order costs, in-order counts),
# all stored so that "smaller is better" and comparable with plain tuple comparison.
_Key = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _descending(values: tuple[int, ...], value: int) -> tuple[int, ...]:
    """`values` (sorted largest first) with `value` inserted in place."""
    merged = list(values)
    insort(merged, value, key=lambda item: -item)
    return tuple(merged)


def _extend(key: _Key, cost: int, count: int) -> _Key:
    cost_profile, count_profile, costs, counts = key
    # Profiles: largest first, smaller is better. In-order vectors: negated, so heavier/longer first wins.
    return (
        _descending(cost_profile, cost),
        _descending(count_profile, count),
        costs + (-cost,),
        counts + (-count,),
    )


def solve_balance(costs: Sequence[float], parts: int) -> list[int]:
    """The contiguous split of `costs` into `parts` runs (>= 1 block each) minimising the heaviest run.

    Exact (dynamic programming over prefixes); ties are broken as described in this module's docstring.
    Returns the number of blocks of each part, in order.
    """
    values = _exact_integers(costs)
    n = len(values)
    _check_parts(n, parts)
    prefix = [0]
    for value in values:
        prefix.append(prefix[-1] + value)
    # weight[i][j] = exact cost of blocks [i, j) (only i <= j is used).
    weight = [[stop_sum - start_sum for stop_sum in prefix] for start_sum in prefix]
    bottleneck = _min_bottleneck(weight, n, parts)

    # Each key compares sorted-descending profiles; adding the same part to two partial splits keeps
    # their order, so the best split of a prefix extends to the best split of the whole.
    empty: _Key = ((), (), (), ())
    best: list[tuple[_Key, tuple[int, ...]] | None] = [None] * (n + 1)
    best[0] = (empty, ())
    for p in range(1, parts + 1):
        new: list[tuple[_Key, tuple[int, ...]] | None] = [None] * (n + 1)
        for stop in range(p, n - (parts - p) + 1):
            for start in range(p - 1, stop):
                previous = best[start]
                cost = weight[start][stop]
                if previous is None or cost > bottleneck:
                    continue
                candidate = (_extend(previous[0], cost, stop - start), previous[1] + (stop - start,))
                current = new[stop]
                if current is None or candidate[0] < current[0]:
                    new[stop] = candidate
        best = new
    solution = best[n]
    if solution is None:  # unreachable: the bottleneck itself is achievable
        raise RuntimeError(f"no split of {n} blocks into {parts} parts found")
    return list(solution[1])
