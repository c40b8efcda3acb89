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
