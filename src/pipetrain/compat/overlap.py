"""DualPipeV's fused actions run concurrently (torch 2.13's `_PipelineScheduleRuntime`), and whether a thread is
inside a backward pass.

DualPipeV's order fuses a forward of one micro-batch with a backward of another (`OVERLAP_F_B`, two sub-actions,
always on the rank's two different stages); torch's runtime runs the two one after the other. `overlap_fused_actions`
registers a function for that action which runs the forward in the calling thread while a second thread runs the
backward (torch's ops and gloo's waits release the GIL), so that one micro-batch's all-to-all waits while the other
computes — what DualPipe is for. It does what torch's runtime does for each sub-action (wait for the received
input, forward or backward the chunk, compute the last stage's loss, pass values between the V's two local
stages), in the same order within each thread, so the values are the same as run in turn. No other collective runs
inside the two: data parallelism under DualPipeV is FSDP2 (pipetrain refuses DDP there), whose gathers run at the
runtime's UNSHARD actions and whose reductions at its REDUCE_GRAD actions, both in the caller between actions; the
experts' exchanges take one group per thread (`in_backward`). Forward outputs are kept (`step`'s default).

`in_backward` tells which of two expert-parallel groups a collective uses (`pipetrain.moe.dispatch`): the backward's
(a recomputed forward included) or the forward's, each group then issued in one deterministic order on every rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining.schedules import _ComputationType

__all__ = ["in_backward", "overlap_fused_actions"]


def in_backward() -> bool:
    """Whether this thread runs autograd's backward now (a forward recomputed inside it included)."""
    return torch._C._current_graph_task_id() != -1


def _concurrently(first: Callable[[], None], second: Callable[[], None]) -> None:
    """`first` here while `second` runs in a new thread; the first error of either is raised after both end."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            second()
        except BaseException as error:  # noqa: BLE001 - raised again in the caller
            errors.append(error)

    thread = threading.Thread(target=run, name="pipetrain-overlapped-backward", daemon=True)
    thread.start()
    try:
        first()
    finally:
        thread.join()
    if errors:
        raise errors[0]


def overlap_fused_actions(schedule: Any) -> None:
    """Run each OVERLAP_F_B action of `schedule` (a torch `ScheduleDualPipeV`) as a forward here and a backward
    in a second thread, at the same time."""
    stages = {stage.stage_index: stage for stage in schedule._stages}

    def forward(action: Any, ctx: Any) -> None:
        index, mb = action.stage_index, action.microbatch_index
        stage = stages[index]
        schedule._assert_unsharded(stage)
        if not stage.is_first and index - 1 not in stages:  # the V's local hop has no receive
            _schedules._wait_batch_p2p(schedule.fwd_recv_ops.pop((index, mb)))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=True)
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if index + 1 in stages:
            stages[index + 1].set_local_fwd_input(output, mb)

    def backward(action: Any) -> Callable[[], None]:
        """The backward to run (its loss and counters taken here, in the caller)."""
        index, mb = action.stage_index, action.microbatch_index
        stage = stages[index]
        schedule._assert_unsharded(stage)
        loss = schedule._maybe_get_loss(stage, mb)
        schedule.backward_counter[index] += 1
        last = schedule.backward_counter[index] == schedule._n_microbatches

        def run() -> None:
            if not stage.is_last and index + 1 not in stages:
                _schedules._wait_batch_p2p(schedule.bwd_recv_ops.pop((index, mb)))
            stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
            if index - 1 in stages:
                stages[index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

        return run

    def fused(action: Any, ctx: Any) -> None:
        kinds = [sub.computation_type for sub in action.sub_actions]
        if kinds != [_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD]:
            raise AssertionError(f"an OVERLAP_F_B of {kinds}: pipetrain overlaps a FORWARD with a FULL_BACKWARD")
        _concurrently(lambda: forward(action.sub_actions[0], ctx), backward(action.sub_actions[1]))

    schedule.register_custom_function(_ComputationType.OVERLAP_F_B, fused)
