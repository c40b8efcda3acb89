"""Exactness of the schedule simulator where theory is exact: bubble, in-flight activations, recomputation."""

from __future__ import annotations

import pytest

from pipetrain.plan.schedules import schedule_order
from pipetrain.plan.simulate import StageCost, recomputed_microbatches, simulate

TABLE = [(p, m) for p in (2, 3, 4, 8) for m in (4, 8, 12, 16, 32) if m % p == 0 or p == 3]


def _equal(stages: int, forward: float = 1.0, backward: float = 2.0, act: float = 1.0, inp: float = 0.0) -> list[StageCost]:
    return [StageCost(forward_s=forward, backward_s=backward, activation_bytes=act, input_bytes=inp)] * stages


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ratio", [1.0, 2.0])
def test_bubble_equals_closed_form(schedule, ratio):
    for p, m in TABLE:
        timeline = simulate(schedule_order(schedule, p, m), _equal(p, 1.0, ratio))
        assert timeline.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
        assert timeline.compute_span_s == pytest.approx((m + p - 1) * (1.0 + ratio))


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_equals_closed_form(v):
    """Narayanan et al. 2021: the bubble shrinks to (p-1)/v slots, i.e. a fraction (p-1)/(v*m + p - 1)."""
    for p, m in TABLE:
        if m % p:
            continue
        costs = _equal(p * v, 1.0 / v, 2.0 / v)
        timeline = simulate(schedule_order("interleaved-1f1b", p, m, v), costs)
        assert timeline.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)


def test_zero_bubble_beats_interleaved():
    p, m = 4, 8
    costs = _equal(2 * p, 0.5, 1.0)
    zb = simulate(schedule_order("zero-bubble", p, m, 2), costs).bubble
    assert zb < simulate(schedule_order("interleaved-1f1b", p, m, 2), costs).bubble


def test_1f1b_holds_at_most_p_microbatches_gpipe_holds_m():
    for p, m in TABLE:
        if m < p:
            continue
        gpipe = simulate(schedule_order("gpipe", p, m), _equal(p))
        one = simulate(schedule_order("1f1b", p, m), _equal(p))
        assert gpipe.peak_inflight == (m,) * p
        assert one.peak_inflight == tuple(p - r for r in range(p))
        assert max(one.peak_activation_bytes) == p  # one micro-batch's worth is 1 byte here
        assert max(gpipe.peak_activation_bytes) == m


def test_communication_delays_cross_rank_edges_only():
    p, m, send = 2, 4, 0.25
    costs = [StageCost(forward_s=1.0, backward_s=2.0, send_s=send)] * p
    timeline = simulate(schedule_order("gpipe", p, m), costs)
    # one forward hop and one backward hop on the critical path
    assert timeline.compute_span_s == pytest.approx((m + p - 1) * 3.0 + 2 * send)


def test_recomputation_costs_a_forward_and_saves_memory():
    p, m = 2, 4
    costs = _equal(p, 1.0, 2.0, act=10.0, inp=1.0)
    plain = simulate(schedule_order("gpipe", p, m), costs)
    again = simulate(schedule_order("gpipe", p, m), costs, recomputed=recomputed_microbatches("always", m))
    assert again.busy_s[0] == pytest.approx(plain.busy_s[0] + m * 1.0)
    assert plain.peak_activation_bytes[0] == 40.0
    assert again.peak_activation_bytes[0] == 3 * 1.0 + 10.0  # m inputs held, one rematerialised at a time


def test_recompute_policies_match_the_engine():
    from pipetrain.pipeline.recompute import recomputes

    for policy in ("never", "except_last", "always"):
        for count in (1, 2, 5):
            assert recomputed_microbatches(policy, count) == {i for i in range(count) if recomputes(policy, i, count)}
