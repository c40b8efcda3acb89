"""pipetrain's pure schedule orders equal torch's own, for every supported schedule over a table of sizes."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.compat.pipelining import torch_lowers, torch_schedule_order
from pipetrain.plan.schedules import Action, min_microbatches, rank_stages, schedule_order, stage_rank

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 6, 8, 12, 16, 32)]
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("interleaved-1f1b", 4),
         ("zero-bubble", 2), ("zero-bubble", 3), ("zbv", 2), ("dualpipev", 2)]
V_SIZES = [(p, m) for p in (2, 4) for m in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)]


def _supported(schedule: str, p: int, m: int, v: int) -> bool:
    if m < min_microbatches(schedule, p):
        return False
    return v == 1 or schedule in ("zbv", "dualpipev") or m % max(1, m // p) == 0


def _plain(order: list[list[Action]]) -> list[list[tuple]]:
    """As compat writes torch's: (stage, kind, microbatch), with a fourth item True on a fused action."""
    return [[tuple(action) if action.fused else tuple(action)[:3] for action in actions] for actions in order]


@pytest.mark.parametrize("schedule,v", CASES)
def test_order_equals_torch(schedule, v):
    checked = 0
    for p, m in SIZES + V_SIZES:
        if not _supported(schedule, p, m, v):
            continue
        ours = _plain(schedule_order(schedule, p, m, v))
        theirs = torch_schedule_order(schedule, p, m, v)
        if schedule == "1f1b":
            # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..m (its
            # forward counter is bumped before the first use when there is no warm-up); what it runs
            # (`_step_microbatches`) is F0 first. Ours is the executed order: compare with that fix applied.
            last = theirs[-1]
            theirs[-1] = [(s, k, mb - 1) if k == "F" else (s, k, mb) for s, k, mb in last]
        assert ours == theirs, f"{schedule} p={p} m={m} v={v}"
        checked += 1
    assert checked >= 20


def test_torch_1f1b_last_rank_off_by_one_is_still_there():
    """When torch fixes its 1F1B order, the workaround above must go: this test says so."""
    theirs = torch_schedule_order("1f1b", 2, 2)
    assert theirs[1][0] == (1, "F", 1), "torch fixed Schedule1F1B's order: drop the fix in test_order_equals_torch"


def test_orders_hold_every_action_once():
    for schedule, v in CASES:
        p, m = 4, 8
        order = schedule_order(schedule, p, m, v)
        style = "v" if schedule in ("zbv", "dualpipev") else "loop"
        for rank, actions in enumerate(order):
            want = sorted((s, i) for s in rank_stages(rank, p, v, style) for i in range(m))
            assert sorted((a.stage, a.microbatch) for a in actions if a.kind == "F") == want
            full = [(a.stage, a.microbatch) for a in actions if a.kind == "B"]
            inputs = [(a.stage, a.microbatch) for a in actions if a.kind == "I"]
            weights = [(a.stage, a.microbatch) for a in actions if a.kind == "W"]
            assert sorted(inputs) == sorted(weights) and sorted(full + inputs) == want, schedule
            assert sum(a.kind == "R" for a in actions) == v
            if schedule != "dualpipev":
                assert not any(a.fused for a in actions)
            else:  # a fused action is a forward followed by a full backward of the rank's other stage
                for a, b in zip(actions, actions[1:]):
                    assert not a.fused or (a.kind, b.kind) == ("F", "B") and a.stage != b.stage


def test_v_placement():
    """V schedules: rank r holds stages r and 2p-1-r, as torch's `generate_stage_to_rank_mapping(style="v")`."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for p in (1, 2, 3, 4, 8):
        assert [stage_rank(s, p, "v") for s in range(2 * p)] == list(range(p)) + list(range(p - 1, -1, -1))
        for stages in (2 * p, 4 * p):
            torch_map = generate_stage_to_rank_mapping(p, stages, style="v")
            assert [stage_rank(s, p, "v") for s in range(stages)] == [torch_map[s] for s in range(stages)]
        assert rank_stages(0, p, 2, "v") == [0, 2 * p - 1]
        for rank, actions in enumerate(schedule_order("zbv", p, 2 * p, 2)):
            assert {a.stage for a in actions} == {rank, 2 * p - 1 - rank}


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_torch_validates_and_lowers_the_v_orders(schedule):
    """torch's own checks (every action once, in a valid order; sends and receives placeable) pass on the
    orders compared above: zbv for any m >= 1, dualpipev from m = 2p (torch's __init__ refuses fewer)."""
    for p, m in V_SIZES:
        if m >= min_microbatches(schedule, p):
            assert torch_lowers(schedule, p, m)
    assert min_microbatches("zbv", 4) == 1 and min_microbatches("dualpipev", 4) == 8


@pytest.mark.parametrize("args", [("pipedream", 2, 4, 1), ("1f1b", 4, 2, 1), ("gpipe", 2, 4, 2),
                                  ("interleaved-1f1b", 2, 4, 1), ("interleaved-1f1b", 4, 9, 2), ("gpipe", 0, 1, 1),
                                  ("zbv", 2, 4, 1), ("zbv", 2, 4, 4), ("dualpipev", 2, 3, 2), ("dualpipev", 4, 7, 2)])
def test_bad_sizes_are_config_errors(args):
    with pytest.raises(ConfigError):
        schedule_order(*args)
