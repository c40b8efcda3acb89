"""Tests of the pure partition solver, on plain lists (exactness checked against brute force)."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from pipetrain.errors import ConfigError
from pipetrain.partition.solver import balance_bounds, solve_balance, uniform_balance


def all_splits(n: int, parts: int):
    for cuts in itertools.combinations(range(1, n), parts - 1):
        edges = (0, *cuts, n)
        yield [edges[i + 1] - edges[i] for i in range(parts)]


def part_costs(costs, balance):
    """Exact part costs (no float rounding)."""
    return [sum(map(Fraction, costs[a:b]), Fraction(0)) for a, b in balance_bounds(balance)]


def documented_key(costs, balance):
    """The order the solver's docstring promises: leximax costs, leximax counts, heavier first, longer first."""
    parts = part_costs(costs, balance)
    return (
        sorted(parts, reverse=True),
        sorted(balance, reverse=True),
        [-c for c in parts],
        [-b for b in balance],
    )


def test_uniform_balance_counts_differ_by_at_most_one_larger_first():
    assert uniform_balance(10, 4) == [3, 3, 2, 2]
    assert uniform_balance(8, 4) == [2, 2, 2, 2]
    assert uniform_balance(5, 5) == [1] * 5
    assert uniform_balance(7, 1) == [7]
    for n in range(1, 30):
        for k in range(1, n + 1):
            balance = uniform_balance(n, k)
            assert sum(balance) == n and len(balance) == k
            assert max(balance) - min(balance) <= 1
            assert balance == sorted(balance, reverse=True)


def test_balance_bounds():
    assert balance_bounds([2, 3, 1]) == [(0, 2), (2, 5), (5, 6)]
    assert balance_bounds([]) == []
    with pytest.raises(ConfigError):
        balance_bounds([2, 0])


@pytest.mark.parametrize("func", [lambda k: uniform_balance(3, k), lambda k: solve_balance([1.0, 2.0, 3.0], k)])
def test_too_many_or_too_few_parts(func):
    with pytest.raises(ConfigError) as info:
        func(5)
    assert "3 blocks" in str(info.value) and "5 parts" in str(info.value)
    assert info.value.hint and "at most 3" in info.value.hint
    for bad in (0, -1):
        with pytest.raises(ConfigError):
            func(bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "x"])
def test_invalid_costs(bad):
    with pytest.raises(ConfigError, match="block 1"):
        solve_balance([1.0, bad, 2.0], 2)


def test_known_answers():
    assert solve_balance([1, 1, 1, 1], 2) == [2, 2]
    assert solve_balance([4, 1, 1, 1, 1], 2) == [1, 4]
    assert solve_balance([1, 1, 1, 1, 4], 2) == [4, 1]
    # The heaviest part is fixed by the 10; the rest is balanced, not dumped on the last part.
    assert solve_balance([10, 1, 1, 1, 1, 1, 1], 3) == [1, 3, 3]
    assert solve_balance([5], 1) == [1]
    assert solve_balance([3, 3, 3], 3) == [1, 1, 1]


def test_equal_and_zero_costs_match_uniform():
    for n in range(1, 13):
        for k in range(1, n + 1):
            assert solve_balance([2.5] * n, k) == uniform_balance(n, k)
            assert solve_balance([0] * n, k) == uniform_balance(n, k)


def test_float_costs_are_compared_exactly():
    # As binary floats, 0.1 + 0.2 + 0.3 is a hair more than 0.3 + 0.3; rounded sums (fsum) both give 0.6
    # and the tie rules would wrongly pick [3, 1].
    assert solve_balance([0.1, 0.2, 0.3, 0.3], 2) == [2, 2]
    assert solve_balance([0.5, 0.25, 0.25, 0.5], 2) == [2, 2]
    assert solve_balance([1e-300, 1e300, 1e-300], 2) == [2, 1]
    assert solve_balance([2**60 + 1, 2**60, 1], 2) == [1, 2]


@pytest.mark.parametrize("kind", ["int", "float"])
def test_exact_against_brute_force(kind):
    rng = random.Random(1234 if kind == "int" else 99)
    for _ in range(250):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        if kind == "int":
            costs = [rng.randint(0, 6) for _ in range(n)]
        else:
            costs = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
        got = solve_balance(costs, parts)
        assert len(got) == parts and sum(got) == n and min(got) >= 1
        splits = list(all_splits(n, parts))
        best_bottleneck = min(max(part_costs(costs, s)) for s in splits)
        assert max(part_costs(costs, got)) == best_bottleneck, (costs, parts, got)
        expected = min(splits, key=lambda s: documented_key(costs, s))
        assert got == expected, (costs, parts, got, expected)


def test_input_is_not_modified_and_tuples_accepted():
    costs = (3, 1, 4, 1, 5, 9, 2, 6)
    assert solve_balance(costs, 3) == solve_balance(list(costs), 3)
    assert costs == (3, 1, 4, 1, 5, 9, 2, 6)


def test_larger_problem_is_fast_and_valid():
    rng = random.Random(7)
    costs = [rng.uniform(1, 2) for _ in range(120)]
    balance = solve_balance(costs, 8)
    assert sum(balance) == 120 and len(balance) == 8
    worst = max(part_costs(costs, balance))
    assert worst <= sum(costs) / 8 + 2  # within one block of the perfect split
