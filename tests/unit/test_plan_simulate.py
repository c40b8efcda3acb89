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


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)])
def test_sharing_at_full_speed_equals_dedicated_devices(schedule, v):
    """The event-by-event simulation of shared cores, run at full speed, gives the list schedule's times."""
    from pipetrain.plan.simulate import _compile, _dedicated, _shared

    p, m = 4, 8
    costs = [StageCost(forward_s=1.0 + 0.1 * s, backward_s=2.0, send_s=0.3, reduce_s=0.5) for s in range(p * v)]
    program = _compile(tuple(tuple(a) for a in schedule_order(schedule, p, m, v)))
    dedicated = _dedicated(program, costs, {1, 3}, 0.05)
    shared = _shared(program, costs, {1, 3}, 0.05, (1.0,) * p)
    for got, want in zip(shared, dedicated):
        assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_one_core_shared_by_every_rank_runs_all_the_work_back_to_back(schedule, v):
    """p ranks on one core (each of n busy ranks at 1/n speed): without transfers the core never idles,
    so the step lasts the sum of every action; with p cores it is the pipeline's span."""
    p, m = 4, 8
    costs = _equal(p * v, 1.0 / v, 2.0 / v)
    one_core = simulate(schedule_order(schedule, p, m, v), costs, speeds=[1.0 / n for n in range(1, p + 1)])
    assert one_core.span_s == pytest.approx(p * m * 3.0)
    assert sum(one_core.busy_s) == pytest.approx(p * m * 3.0)
    own = simulate(schedule_order(schedule, p, m, v), costs)
    assert own.span_s < one_core.span_s


def test_two_cores_for_two_ranks_with_contention():
    """Two ranks, two cores, each 25 % slower while both compute: GPipe's overlapped middle slows down."""
    p, m = 2, 4
    costs = _equal(p, 1.0, 2.0)
    plain = simulate(schedule_order("gpipe", p, m), costs)
    slowed = simulate(schedule_order("gpipe", p, m), costs, speeds=(1.0, 0.8))
    assert plain.span_s == pytest.approx((m + p - 1) * 3.0)
    # forwards: rank 0 alone 1 s, then 3 overlapped forwards at 0.8 (3.75 s), rank 1's last forward alone;
    # backwards mirror them: 2 s alone, 3 overlapped at 0.8 (7.5 s), 2 s alone
    assert slowed.span_s == pytest.approx(1.0 + 3.75 + 1.0 + 2.0 + 7.5 + 2.0)
