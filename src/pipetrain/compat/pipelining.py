"""Private names of `torch.distributed.pipelining` (torch 2.13): schedule orders as plain data, the V placement's
breadth-first schedule, and timed P2P waits.

`torch_schedule_order` asks torch's own schedule classes for the order of actions of each rank, without a
process group or stages: the order methods only read a few sizes from `self`, so they are called on a
plain namespace holding those sizes (the V schedules compute theirs in `__init__` from the stages, by
the same `_calculate_single_rank_operations`, which reads only `pp_group_size`, `_n_microbatches` and
`num_stages`). `torch_lowers` runs torch's own lowering of an order to sends and receives, which raises
when the order cannot run. `BreadthFirstV` overrides a schedule's private order method. Every private name
used is listed in `pipetrain.compat.PRIVATE_NAMES`; tests/unit/test_compat.py fails loudly when one moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining.schedules import _Action, _ComputationType

__all__ = ["torch_schedule_order", "torch_lowers", "timed_p2p_waits", "BreadthFirstV"]

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


class BreadthFirstV(ScheduleLoopedBFS):
    """GPipe order over the V placement (rank r holds stages r and 2p - 1 - r): every forward of the rank's first
    stage, then of its second, then the second's backwards, then the first's.

    What a V-shaped job runs where its own schedule cannot: forward-only passes (torch 2.13's `eval()` of
    `ScheduleZBVZeroBubble` and `ScheduleDualPipeV` fails) and a batch's remainder micro-batch. torch infers the
    stage-to-rank mapping from these actions, so the V's middle hop (stage p - 1 to p) stays on one rank.
    """

    def __init__(self, stages: list[PipelineStage], n_microbatches: int, *, train: bool, **kwargs) -> None:
        super().__init__(stages, n_microbatches, **kwargs)
        if not train:  # torch's runtime would hand the V's local hop a gradient that a forward-only stage lacks;
            # the backward is skipped, and its (empty: no backward) receive forgotten, as running it would
            def skip(action: _Action, ctx: object) -> None:
                self.bwd_recv_ops.pop((action.stage_index, action.microbatch_index), None)

            self.register_custom_function(_ComputationType.FULL_BACKWARD, skip)

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action | None]:
        first, second = rank, 2 * self.pp_group_size - 1 - rank
        forward, backward = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
        micro = range(self._n_microbatches)
        return ([_Action(stage, forward, mb) for stage in (first, second) for mb in micro]
                + [_Action(stage, backward, mb) for stage in (second, first) for mb in reversed(micro)])
