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
from collections.abc import Callable, Sequence

from pipetrain.errors import ConfigError

__all__ = ["solve_balance", "uniform_balance", "balance_bounds", "smallest_cap", "InfeasibleCapError"]


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


def _min_bottleneck(weight: _Weight, n: int, parts: int, allowed: _Allowed | None = None) -> int | None:
    """The smallest achievable cost of the heaviest part (min-max dynamic programming), None if no split
    has every part `allowed`."""
    best: list[int | None] = [None] * (n + 1)
    best[0] = 0
    for p in range(1, parts + 1):
        new: list[int | None] = [None] * (n + 1)
        for stop in range(p, n - (parts - p) + 1):
            options = [
                max(previous, weight(p - 1, start, stop))
                for start in range(p - 1, stop)
                if (previous := best[start]) is not None and (allowed is None or allowed(p - 1, start, stop))
            ]
            new[stop] = min(options) if options else None
        best = new
    return best[n]


# A partial solution's sort key: (leximax costs, leximax counts, in-order costs, in-order counts),
# all stored so that "smaller is better" and comparable with plain tuple comparison.
_Key = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
_Weight = Callable[[int, int, int], int]  # (part, start, stop) -> exact cost of blocks [start, stop) in `part`
_Allowed = Callable[[int, int, int], bool]


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


def _rows(costs: Sequence[float] | Sequence[Sequence[float]], parts: int) -> list[list[float]]:
    """`costs` as one row per part (a single row of per-block costs is shared by every part)."""
    if costs and isinstance(costs[0], Sequence):
        return [list(row) for row in costs]  # type: ignore[arg-type]
    return [list(costs)] * parts  # type: ignore[arg-type]


def _part_prefixes(
    costs: Sequence[float] | Sequence[Sequence[float]], parts: int, what: str, extra: float = 0
) -> tuple[list[list[int]], int]:
    """Exact integer prefix sums of each part's row, and `extra` on the same integer scale."""
    rows = _rows(costs, parts)
    if len(rows) != parts or len({len(row) for row in rows}) != 1:
        raise ConfigError(
            f"{what} has {len(rows)} rows of lengths {sorted({len(row) for row in rows})} for {parts} parts",
            hint="give one cost per block, or one row of per-block costs per part",
        )
    n = len(rows[0])
    flat = _exact_integers([value for row in rows for value in row] + [extra])
    prefixes = []
    for part in range(parts):
        prefix = [0]
        for value in flat[part * n:(part + 1) * n]:
            prefix.append(prefix[-1] + value)
        prefixes.append(prefix)
    return prefixes, flat[-1]


def _weight(prefixes: list[list[int]]) -> _Weight:
    return lambda part, start, stop: prefixes[part][stop] - prefixes[part][start]


def solve_balance(
    costs: Sequence[float] | Sequence[Sequence[float]],
    parts: int,
    *,
    memory: Sequence[float] | Sequence[Sequence[float]] | None = None,
    mem_cap: float | None = None,
) -> list[int]:
    """The contiguous split of `costs` into `parts` runs (>= 1 block each) minimising the heaviest run.

    `costs` is one number per block, or one row of per-block numbers per part (when a block costs more
    on some parts than on others). With `mem_cap`, only splits whose every part's `memory` (same shapes
    as `costs`) sum is at most `mem_cap` are considered; if none is, `InfeasibleCapError` names the
    smallest cap that fits. Exact (dynamic programming over prefixes); ties are broken as described in
    this module's docstring. Returns the number of blocks of each part, in order.
    """
    n = len(costs[0]) if costs and isinstance(costs[0], Sequence) else len(costs)  # type: ignore[arg-type]
    _check_parts(n, parts)
    weight = _weight(_part_prefixes(costs, parts, "costs")[0])
    allowed: _Allowed | None = None
    if mem_cap is not None:
        if memory is None:
            raise ConfigError("a memory cap needs per-block memory costs", hint="pass memory= with mem_cap=")
        memory_prefixes, cap = _part_prefixes(memory, parts, "memory", extra=mem_cap)
        if len(memory_prefixes[0]) != n + 1:
            raise ConfigError(f"memory has {len(memory_prefixes[0]) - 1} blocks, costs {n}",
                              hint="give one memory cost per block")
        memory_weight = _weight(memory_prefixes)
        allowed = lambda part, start, stop: memory_weight(part, start, stop) <= cap  # noqa: E731
        if _min_bottleneck(weight, n, parts, allowed) is None:
            raise InfeasibleCapError(mem_cap, smallest_cap(memory, parts))
    bottleneck = _min_bottleneck(weight, n, parts, allowed)
    if bottleneck is None:  # unreachable: without a cap every split is allowed
        raise RuntimeError(f"no split of {n} blocks into {parts} parts found")

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
                cost = weight(p - 1, start, stop)
                if previous is None or cost > bottleneck or (allowed is not None and not allowed(p - 1, start, stop)):
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


def smallest_cap(memory: Sequence[float] | Sequence[Sequence[float]], parts: int) -> float:
    """The smallest per-part memory cap (bytes) that some split of the blocks into `parts` runs fits under."""
    n = len(memory[0]) if memory and isinstance(memory[0], Sequence) else len(memory)  # type: ignore[arg-type]
    _check_parts(n, parts)
    rows = _rows(memory, parts)
    balance = solve_balance(rows, parts)
    return max(sum(row[a:b]) for row, (a, b) in zip(rows, balance_bounds(balance)))


class InfeasibleCapError(ConfigError):
    """No split fits under the memory cap; `smallest` is the smallest cap that fits."""

    def __init__(self, cap: float, smallest: float) -> None:
        self.cap = cap
        self.smallest = smallest
        super().__init__(
            f"no split of the blocks fits a memory cap of {cap / 2**20:.1f} MB per rank; the smallest cap that "
            f"fits is {smallest / 2**20:.1f} MB",
            hint=f"pass --mem-cap {math.ceil(smallest / 2**20)} or more, more pipeline ranks, or recomputation",
        )
