"""The calibration's arithmetic, without processes: the fit of the smallest sizes and paired ratios."""

from __future__ import annotations

import itertools

import pytest

from pipetrain.bench.calibrate_timing import paired_ratio, relative_fit


def test_fit_recovers_a_line_and_weighs_small_sizes():
    fixed, slope = relative_fit([1, 2, 4], [0.003, 0.005, 0.009])
    assert fixed == pytest.approx(0.001) and slope == pytest.approx(0.002)
    # a line through the origin keeps a zero intercept; noise cannot make it negative
    assert relative_fit([1, 2, 4], [1.0, 2.0, 4.0]) == pytest.approx((0.0, 1.0))
    assert relative_fit([1, 2, 4], [1.0, 0.9, 0.8])[1] > 0


def test_paired_ratio_cancels_drift_and_skips_the_warm_up():
    """A machine slowing 10 % per measurement: side-by-side pairs are off by one measurement's drift
    (1.1x), where six of one then six of the other would be off by 1.1**6 (1.77x)."""
    clock = itertools.count()

    def drifting(cost: float):
        return lambda: cost * 1.1 ** next(clock)

    warm = iter([100.0])  # the first pair is a warm-up: its outlier must not count
    first = drifting(1.25)
    ratio = paired_ratio(lambda: next(warm, None) or first(), drifting(1.0), pairs=6)
    assert ratio == pytest.approx(1.25 / 1.1)  # each pair's second measurement ran one tick later
    assert paired_ratio(lambda: 1.0, lambda: None, pairs=3) is None  # a rank that does not measure
