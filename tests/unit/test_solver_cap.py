"""The partition solver with per-part cost rows and a memory cap, checked against brute force."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from pipetrain.errors import ConfigError
from pipetrain.partition.solver import InfeasibleCapError, balance_bounds, smallest_cap, solve_balance


def all_splits(n: int, parts: int):
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        yield [edges[i + 1] - edges[i] for i in range(parts)]


def part_sums(rows, balance):
    return [sum(map(Fraction, row[a:b]), Fraction(0)) for row, (a, b) in zip(rows, balance_bounds(balance))]


@pytest.mark.parametrize("seed", range(40))
def test_capped_solver_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    parts = rng.randint(1, min(4, n))
    time = [rng.choice([0.5, 1.0, 2.0, 3.25, rng.random() * 4]) for _ in range(n)]
    block_memory = [rng.randint(1, 50) for _ in range(n)]
    in_flight = [rng.randint(1, 4) for _ in range(parts)]  # activations held per part, as 1F1B's first stages
    memory = [[m * k + 3 for m in block_memory] for k in in_flight]
    time_rows = [time] * parts
    splits = list(all_splits(n, parts))
    for cap in sorted({max(part_sums(memory, s)) for s in splits}) + [0.5]:
        fitting = [s for s in splits if max(part_sums(memory, s)) <= cap]
        if not fitting:
            with pytest.raises(InfeasibleCapError) as info:
                solve_balance(time, parts, memory=memory, mem_cap=cap)
            assert info.value.smallest == min(max(part_sums(memory, s)) for s in splits)
            assert "smallest cap that fits" in info.value.message
            continue
        chosen = solve_balance(time, parts, memory=memory, mem_cap=cap)
        assert max(part_sums(memory, chosen)) <= cap
        best = min(max(part_sums(time_rows, s)) for s in fitting)
        assert max(part_sums(time_rows, chosen)) == best


@pytest.mark.parametrize("seed", range(20))
def test_per_part_rows_match_brute_force(seed):
    rng = random.Random(100 + seed)
    n, parts = rng.randint(2, 8), rng.randint(1, 3)
    parts = min(parts, n)
    rows = [[rng.randint(0, 9) for _ in range(n)] for _ in range(parts)]
    chosen = solve_balance(rows, parts)
    assert max(part_sums(rows, chosen)) == min(max(part_sums(rows, s)) for s in all_splits(n, parts))
    assert smallest_cap(rows, parts) == max(part_sums(rows, chosen))


def test_without_cap_the_answer_is_unchanged_and_a_loose_cap_changes_nothing():
    costs = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]
    plain = solve_balance(costs, 3)
    assert solve_balance(costs, 3, memory=[1] * 6, mem_cap=10**9) == plain


def test_a_tight_cap_trades_time_for_memory():
    time = [1, 1, 1, 1]
    memory = [100, 1, 1, 1]
    assert solve_balance(time, 2) == [2, 2]
    assert solve_balance(time, 2, memory=memory, mem_cap=100) == [1, 3]


def test_cap_without_memory_and_mismatched_rows_are_config_errors():
    with pytest.raises(ConfigError, match="memory"):
        solve_balance([1, 2, 3], 2, mem_cap=5)
    with pytest.raises(ConfigError, match="one memory cost per block"):
        solve_balance([1, 2, 3], 2, memory=[1, 2], mem_cap=5)
    with pytest.raises(ConfigError, match="rows"):
        solve_balance([[1, 2, 3]], 2)
