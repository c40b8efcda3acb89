"""pipetrain's pure schedule orders equal torch's own, for every supported schedule over a table of sizes."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.pipeline.compat import torch_schedule_order
from pipetrain.plan.schedules import Action, schedule_order

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 6, 8, 12, 16, 32)]
CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("interleaved-1f1b", 4),
         ("zero-bubble", 2), ("zero-bubble", 3)]


def _supported(schedule: str, p: int, m: int, v: int) -> bool:
    if schedule == "1f1b" and m < p:
        return False
    return v == 1 or m % max(1, m // p) == 0


def _plain(order: list[list[Action]]) -> list[list[tuple[int, str, int]]]:
    return [[tuple(action) for action in actions] for actions in order]


@pytest.mark.parametrize("schedule,v", CASES)
def test_order_equals_torch(schedule, v):
    checked = 0
    for p, m in SIZES:
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
        kinds = ("F", "I", "W") if schedule == "zero-bubble" else ("F", "B")
        for rank, actions in enumerate(order):
            for kind in kinds:
                got = sorted((a.stage, a.microbatch) for a in actions if a.kind == kind)
                assert got == sorted((rank + k * p, i) for k in range(v) for i in range(m))
            assert sum(a.kind == "R" for a in actions) == v


@pytest.mark.parametrize("args", [("pipedream", 2, 4, 1), ("1f1b", 4, 2, 1), ("gpipe", 2, 4, 2),
                                  ("interleaved-1f1b", 2, 4, 1), ("interleaved-1f1b", 4, 9, 2), ("gpipe", 0, 1, 1)])
def test_bad_sizes_are_config_errors(args):
    with pytest.raises(ConfigError):
        schedule_order(*args)
