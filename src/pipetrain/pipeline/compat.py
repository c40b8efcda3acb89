"""The one place that touches private names of `torch.distributed.pipelining` (torch 2.13); keep additions here.

`torch_schedule_order` asks torch's own schedule classes for the order of actions of each rank, without a
process group or stages: the order methods only read a few sizes from `self`, so they are called on a
plain namespace holding those sizes (the V schedules compute theirs in `__init__` from the stages, by
the same `_calculate_single_rank_operations`, which reads only `pp_group_size`, `_n_microbatches` and
`num_stages`). `torch_lowers` runs torch's own lowering of an order to sends and receives, which raises
when the order cannot run. `tests/unit/test_pipeline_compat.py` fails loudly when any of these
private names moves or changes shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from torch.distributed.pipelining import schedules as _schedules

__all__ = ["torch_schedule_order", "torch_lowers", "PRIVATE_NAMES", "timed_p2p_waits"]

#: Every private torch name this module relies on (the compat test checks each still exists).
PRIVATE_NAMES = (
    "ScheduleGPipe._get_pipeline_order",
    "Schedule1F1B._get_pipeline_order",
    "ScheduleInterleaved1F1B._calculate_single_rank_operations",
    "ScheduleInterleavedZeroBubble._calculate_single_rank_operations",
    "ScheduleInterleavedZeroBubble._add_bubbles_to_actions",
    "ScheduleZBVZeroBubble._calculate_single_rank_operations",
    "ScheduleDualPipeV._calculate_single_rank_operations",
    "_Action.sub_actions",
    "_add_send_recv",
    "_validate_schedule",
    "_Action",
    "_ComputationType",
    "_add_reduce_grad",
    "_wait_batch_p2p",
)


def _one(action, fused: bool = False) -> tuple:
    mb = -1 if action.microbatch_index is None else int(action.microbatch_index)
    kind = str(action.computation_type.value)
    plain = (int(action.stage_index), "R" if kind == "REDUCE_GRAD" else kind, mb)
    return (*plain, True) if fused else plain


def _plain(order: dict[int, list]) -> list[list[tuple]]:
    """torch's `{rank: [_Action | None]}` as plain `(stage, kind, microbatch)` lists, idle slots dropped; an
    OVERLAP_F_B as its sub-actions, the first one with a fourth item True (fused with the next)."""
    out = []
    for rank in sorted(order):
        actions = []
        for action in order[rank]:
            if action is None:
                continue
            subs = action.sub_actions
            if subs:
                actions += [_one(sub, fused=i < len(subs) - 1) for i, sub in enumerate(subs)]
            else:
                actions.append(_one(action))
        out.append(actions)
    return out


def _v_order(schedule: str, pp: int, n_microbatches: int) -> dict[int, list]:
    cls = _schedules.ScheduleZBVZeroBubble if schedule == "zbv" else _schedules.ScheduleDualPipeV
    fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=n_microbatches, num_stages=2 * pp)
    return {rank: cls._calculate_single_rank_operations(fake, rank) for rank in range(pp)}


def torch_lowers(schedule: str, pp: int, n_microbatches: int) -> bool:
    """Whether torch validates a V schedule's order and lowers it to sends and receives (it raises
    AssertionError on an order that misses actions or cannot run)."""
    order = _v_order(schedule, pp, n_microbatches)
    mapping = _schedules._validate_schedule(order, pp, 2 * pp, n_microbatches)
    _schedules._add_send_recv({r: [a for a in acts if a is not None] for r, acts in order.items()},
                              stage_to_rank=lambda s: mapping[s], num_stages=2 * pp)
    return True


def torch_schedule_order(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> list[list[tuple]]:
    """torch's order of actions for `schedule` (pipetrain's name), one list per rank; REDUCE_GRAD as "R".
    The V schedules ("zbv", "dualpipev") always have 2 stages per rank (`virtual_stages` is ignored)."""
    if schedule in ("gpipe", "1f1b"):
        cls = _schedules.ScheduleGPipe if schedule == "gpipe" else _schedules.Schedule1F1B
        fake = SimpleNamespace(_num_stages=pp, _n_microbatches=n_microbatches)
        return _plain(cls._get_pipeline_order(fake))
    if schedule in ("zbv", "dualpipev"):
        order = _v_order(schedule, pp, n_microbatches)
        return _plain({rank: _schedules._add_reduce_grad(actions, n_microbatches) for rank, actions in order.items()})
    if schedule not in ("interleaved-1f1b", "zero-bubble"):
        raise ValueError(f"no torch order for schedule {schedule!r}")
    cls = _schedules.ScheduleInterleaved1F1B if schedule == "interleaved-1f1b" else _schedules.ScheduleInterleavedZeroBubble
    rounds = max(1, n_microbatches // pp)
    fake = SimpleNamespace(
        n_local_stages=virtual_stages,
        pp_group_size=pp,
        _n_microbatches=n_microbatches,
        number_of_rounds=rounds,
        microbatches_per_round=n_microbatches // rounds,
    )
    order = {rank: cls._calculate_single_rank_operations(fake, rank) for rank in range(pp)}
    if schedule == "zero-bubble":
        fake.pipeline_order = order
        order = cls._add_bubbles_to_actions(fake, virtual_stages * pp)
    return _plain({rank: _schedules._add_reduce_grad(actions, n_microbatches) for rank, actions in order.items()})


@contextmanager
def timed_p2p_waits(record: Callable[[Any, Any], None],
                    now: Callable[[], Any] = time.perf_counter_ns) -> Iterator[None]:
    """While inside, every wait of the schedules on their P2P sends/receives calls `record(start, end)`, two
    readings of `now` (host nanoseconds by default; a `pipetrain.pipeline.clock` mark on CUDA, where the wait
    only makes the stream wait and the device's clock sees how long).

    torch's schedules wait through the module-level `_wait_batch_p2p` (looked up at each call), so it is
    swapped for a timed version here and restored on exit.
    """
    original = _schedules._wait_batch_p2p

    def timed(work: Any) -> Any:
        start = now()
        try:
            return original(work)
        finally:
            record(start, now())

    _schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        _schedules._wait_batch_p2p = original
