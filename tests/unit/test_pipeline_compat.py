"""The private torch names of `pipetrain.pipeline.compat` still exist (fails loudly when torch moves them)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules

from pipetrain.pipeline.compat import PRIVATE_NAMES, torch_schedule_order


@pytest.mark.parametrize("name", PRIVATE_NAMES)
def test_private_torch_name_exists(name):
    target = schedules
    for part in name.split("."):
        assert hasattr(target, part), f"torch.distributed.pipelining.schedules.{name} moved: update pipeline/compat.py"
        target = getattr(target, part)


def test_torch_order_is_plain_data():
    order = torch_schedule_order("gpipe", 2, 2)
    assert order == [
        [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1), (0, "R", -1)],
        [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1), (1, "R", -1)],
    ]
    with pytest.raises(ValueError):
        torch_schedule_order("dualpipe", 2, 2)


def test_torch_v_orders_are_plain_data_with_fused_pairs():
    """DualPipeV's OVERLAP_F_B comes out as its two sub-actions, the forward marked fused; ZB-V has none."""
    order = torch_schedule_order("dualpipev", 2, 4)
    fused = [(rank, i) for rank, actions in enumerate(order) for i, a in enumerate(actions) if len(a) == 4]
    assert fused and all(order[r][i][1:] == ("F", order[r][i][2], True) and order[r][i + 1][1] == "B"
                         for r, i in fused)
    assert all(len(a) == 3 for actions in torch_schedule_order("zbv", 2, 4) for a in actions)
    assert {a[0] for a in torch_schedule_order("zbv", 2, 4)[0]} == {0, 3}  # rank 0 holds stages 0 and 2p-1


def test_torch_lowering_refuses_an_order_that_misses_actions():
    from pipetrain.pipeline.compat import torch_lowers

    assert torch_lowers("zbv", 2, 1)
    with pytest.raises(AssertionError):
        torch_lowers("dualpipev", 2, 2)  # fewer than 2p - 1: torch's generator runs extra forwards
