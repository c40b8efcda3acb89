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
    # a transfer starts when the receiver posts its receive (reaches the action), so none overlaps the
    # receiver's work: every micro-batch's hop, forward and backward, is on the critical path
    assert timeline.compute_span_s == pytest.approx((m + p - 1) * 3.0 + 2 * m * send)
    same_rank = simulate(schedule_order("gpipe", 1, m), [StageCost(forward_s=2.0, backward_s=4.0, send_s=send)])
    assert same_rank.compute_span_s == pytest.approx(m * 6.0)  # no hop crosses ranks: nothing sent


def test_a_transfer_waits_for_the_link_and_the_receiver():
    """A slow link (transfers longer than the compute): the forward hops queue on the link one after another."""
    p, m, send = 2, 4, 5.0
    costs = [StageCost(forward_s=1.0, backward_s=2.0, send_s=send)] * p
    timeline = simulate(schedule_order("gpipe", p, m), costs)
    forward_end = 1.0 + m * (send + 1.0)  # stage 1's last forward: each of its inputs crossed after the previous one
    backward = m * (send + 2.0)  # stage 0 receives each gradient after its previous backward
    assert timeline.compute_span_s == pytest.approx(forward_end + 2.0 + backward)


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


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2),
                                        ("zbv", 2), ("dualpipev", 2)])
def test_sharing_at_full_speed_equals_dedicated_devices(schedule, v):
    """The event-by-event simulation of shared cores, run at full speed, gives the list schedule's times."""
    from pipetrain.plan.events import compile_order, dedicated_times, shared_times

    p, m = 4, 8
    costs = [StageCost(forward_s=1.0 + 0.1 * s, backward_s=2.0, send_s=0.3, reduce_s=0.5) for s in range(p * v)]
    program = compile_order(tuple(tuple(a) for a in schedule_order(schedule, p, m, v)))
    dedicated = dedicated_times(program, costs, {1, 3}, 0.05)
    shared = shared_times(program, costs, {1, 3}, 0.05, (1.0,) * p)
    for got, want in zip(shared, dedicated):
        assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2),
                                        ("dualpipev", 2)])
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


V_TABLE = [(p, m) for p in (2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p, 6 * p)]


def _idle(timeline) -> list[float]:
    return [timeline.compute_span_s - busy for busy in timeline.busy_s]


def test_zbv_idles_only_the_startup_skew():
    """ZB-V (Qi et al. 2024, section 6): with equal F, I and W times t per stage, the schedule is zero-bubble
    in steady state: no rank ever waits once started, so each rank idles exactly the start-up skew (p-1)t
    (rank r starts r*t late and ends (p-1-r)*t early: the parallelogram that consecutive steps would tile
    without a synchronising optimizer step), whatever m; bubble fraction (p-1)/(6m+p-1). Holds for
    m >= 2p-1 micro-batches (torch's own minimum for a full pipeline); checked for m >= 2p."""
    from pipetrain.trace.summary import ideal_bubble

    t = 0.5
    for p, m in V_TABLE:
        timeline = simulate(schedule_order("zbv", p, m, 2), _equal(2 * p, t, 2 * t))
        assert _idle(timeline) == pytest.approx([(p - 1) * t] * p, abs=1e-9), (p, m)
        assert timeline.compute_span_s == pytest.approx(6 * m * t + (p - 1) * t)
        assert timeline.bubble == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)
        assert timeline.bubble == pytest.approx(ideal_bubble("zbv", p, m, 2), abs=1e-12)
    # too few micro-batches to fill the V: more than the skew
    short = simulate(schedule_order("zbv", 4, 4, 2), _equal(8, t, 2 * t))
    assert min(_idle(short)) > 3 * t


def test_dualpipev_bubble_equals_deepseeks_formula_with_equal_f_i_w():
    """DeepSeek-V3 (table 2): DualPipe's bubble is (PP/2-1)(F&B+B-3W) on PP ranks; DualPipeV is DualPipe
    folded onto PP/2 = p ranks, so (p-1)(F&B+B-3W), with F&B = F + B here (torch runs its OVERLAP_F_B pair
    one after the other). With F = I = W = t (B = 2t) every rank idles exactly that, 2(p-1)t, for every
    m >= 2p (odd m too); it holds 2p+1 stage activations at its peak (DeepSeek's PP+1 with PP = 2p stages)."""
    from pipetrain.trace.summary import ideal_bubble

    t = 0.5
    f, b, w = t, 2 * t, t
    for p, m in V_TABLE:
        timeline = simulate(schedule_order("dualpipev", p, m, 2), _equal(2 * p, f, b))
        assert _idle(timeline) == pytest.approx([(p - 1) * ((f + b) + b - 3 * w)] * p, abs=1e-9), (p, m)
        assert timeline.bubble == pytest.approx(ideal_bubble("dualpipev", p, m, 2), abs=1e-12)
        assert timeline.peak_inflight == (2 * p + 1,) * p


def test_dualpipev_with_other_ratios_has_no_steady_state_bubble_but_not_the_formula():
    """With F, I, W unequal the simulated torch order still idles the same whatever m (no bubble grows
    with the micro-batches), but not (p-1)(F+2B-3W): e.g. F=1, B=2, W=0.5 at p=2 idles 3.0, the formula
    says 3.5 (and F=2, B=2, W=1: 4.0 against 3.0)."""
    for (f, b, w), p, want, formula in [((1.0, 2.0, 0.5), 2, 3.0, 3.5), ((2.0, 2.0, 1.0), 2, 4.0, 3.0),
                                        ((1.0, 2.0, 0.5), 4, 9.5, 10.5)]:
        costs = [StageCost(forward_s=f, backward_s=b, weight_share=w / b)] * (2 * p)
        for m in (2 * p, 3 * p + 1, 6 * p):
            idle = _idle(simulate(schedule_order("dualpipev", p, m, 2), costs))
            assert idle == pytest.approx([want] * p, abs=1e-9)
            assert (p - 1) * (f + 2 * b - 3 * w) == pytest.approx(formula)


def test_v_schedules_hold_as_much_as_1f1b():
    """ZB-V keeps 1F1B's activation memory (Qi et al.: 2p stage activations = p micro-batches of a rank's
    two stages, 1F1B's first rank)."""
    for p, m in V_TABLE:
        assert simulate(schedule_order("zbv", p, m, 2), _equal(2 * p)).peak_inflight == (2 * p,) * p


def test_the_v_tip_costs_no_transfer():
    """In a V, stage p-1 and stage p are on the same rank: no link is charged for that hop."""
    for schedule in ("zbv", "dualpipev"):
        p, m = 4, 8
        plain = simulate(schedule_order(schedule, p, m, 2), _equal(2 * p, 0.5, 1.0))
        costs = _equal(2 * p, 0.5, 1.0)
        costs[p - 1] = StageCost(forward_s=0.5, backward_s=1.0, activation_bytes=1.0, send_s=100.0)
        assert simulate(schedule_order(schedule, p, m, 2), costs).span_s == pytest.approx(plain.span_s)
        costs[p - 1], costs[p - 2] = costs[p - 2], costs[p - 1]  # the same send on a real hop: slower
        assert simulate(schedule_order(schedule, p, m, 2), costs).span_s > plain.span_s + 100.0


def test_a_fused_action_sends_when_its_pair_ends():
    """torch posts the sends of an OVERLAP_F_B after both halves: the next rank gets the forward's output
    only when the fused pair is done."""
    from pipetrain.plan.schedules import Action

    order = [[Action(0, "F", 0, True), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1)],
             [Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 0), Action(1, "B", 1)]]
    costs = _equal(2, 1.0, 2.0)
    assert simulate(order, costs).span_s == pytest.approx(10.0)  # rank 1 starts at 2 s, not 1 s
    unfused = [[Action(*a[:3]) for a in actions] for actions in order]
    assert simulate(unfused, costs).span_s == pytest.approx(9.0)
