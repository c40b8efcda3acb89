"""The order of actions each pipeline rank runs, generated in pure code for every schedule pipetrain supports.

A schedule is, per rank, a list of actions `(stage, kind, microbatch)` with kind "F" (forward), "B" (full
backward), "I" (backward for the input only), "W" (backward for the weights only) and "R" (the stage's
gradient reduction over data-parallel replicas, placed after its last backward-like action, with
`microbatch` -1). The orders are those of torch 2.13's `torch.distributed.pipelining` schedules, idle slots
removed; `tests/unit/test_plan_schedules.py` checks them against torch's own (through
`pipetrain.pipeline.compat`) for a table of sizes. Stage `s` lives on rank `s % pp`.

- gpipe: every forward, then every backward, micro-batches in order.
- 1f1b: `pp - 1 - rank` warm-up forwards, then alternate one forward and one backward, then drain.
- interleaved-1f1b (Narayanan et al. 2021), zero-bubble (ZB1P of Qi et al. 2024): depth-first over the
  rank's `v` stages in rounds of `m // max(1, m // pp)` micro-batches; zero-bubble splits each backward
  into I then a deferred W.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from pipetrain.errors import ConfigError

__all__ = ["Action", "schedule_order", "stage_rank", "SIMULATED_SCHEDULES"]

SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


class Action(NamedTuple):
    """One step of a rank: `kind` of `stage` on `microbatch` (-1 for "R")."""

    stage: int
    kind: str
    microbatch: int


def stage_rank(stage: int, pp: int) -> int:
    """The pipeline rank holding `stage` (looped placement: stage s on rank s % pp)."""
    return stage % pp


def _with_reduce(actions: list[Action], n_microbatches: int) -> list[Action]:
    """Append each stage's "R" right after its `n_microbatches`-th "B" or "W" (torch's `_add_reduce_grad`)."""
    out: list[Action] = []
    done: dict[int, int] = defaultdict(int)
    for action in actions:
        out.append(action)
        if action.kind in ("B", "W"):
            done[action.stage] += 1
            if done[action.stage] == n_microbatches:
                out.append(Action(action.stage, "R", -1))
    return out


def _gpipe(rank: int, m: int) -> list[Action]:
    return [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = pp - 1 - rank
    actions = [Action(rank, "F", i) for i in range(warmup)]
    backward = 0
    for forward in range(warmup, m):
        actions += [Action(rank, "F", forward), Action(rank, "B", backward)]
        backward += 1
    actions += [Action(rank, "B", i) for i in range(backward, m)]
    return actions


def _rounds(pp: int, m: int, schedule: str) -> int:
    rounds = max(1, m // pp)
    if m % rounds:
        raise ConfigError(
            f"schedule {schedule!r} needs the micro-batch count to be a multiple of {rounds} rounds, got {m}",
            hint=f"use a multiple of pp={pp} micro-batches",
        )
    return m // rounds


def _interleaved(rank: int, pp: int, v: int, m: int, zero_bubble: bool) -> list[Action]:
    per_round = _rounds(pp, m, "zero-bubble" if zero_bubble else "interleaved-1f1b")
    hops = pp - 1 - rank
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * hops, m * v)
    total = m * v  # forwards (and backwards) this rank runs
    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def take(kind: str, stage: int) -> Action:
        index = next_mb[kind, stage]
        next_mb[kind, stage] = index + 1
        return Action(stage, kind, index)

    def forward_stage(op: int) -> int:
        return ((op // per_round) % v) * pp + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    back = "I" if zero_bubble else "B"
    backward_ops: list[int] = []
    weights_done = 0
    actions: list[Action] = []
    for op in range(total + warmup):  # warm-up forwards, steady F+B pairs, cool-down backwards
        if op < total:
            actions.append(take("F", forward_stage(op)))
        if op >= warmup:
            actions.append(take(back, backward_stage(op)))
            backward_ops.append(op)
            if zero_bubble and op - warmup >= rank:  # ZB1P: W waits `rank` backwards, then follows each I
                actions.append(take("W", backward_stage(backward_ops[weights_done])))
                weights_done += 1
    if zero_bubble:
        for op in backward_ops[weights_done:]:
            actions.append(take("W", backward_stage(op)))
    return actions


def schedule_order(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The actions of every rank (index = pipeline rank), "R" included, for `schedule` on `pp` ranks."""
    m, v = n_microbatches, virtual_stages
    if schedule not in SIMULATED_SCHEDULES:
        raise ConfigError(f"no simulator for schedule {schedule!r}", hint=f"use one of: {', '.join(SIMULATED_SCHEDULES)}")
    if pp < 1 or m < 1 or v < 1:
        raise ConfigError(f"pp, micro-batches and virtual stages must be >= 1, got {pp}, {m}, {v}", hint="pass positive sizes")
    multi = schedule in ("interleaved-1f1b", "zero-bubble")
    if multi != (v > 1):
        raise ConfigError(
            f"schedule {schedule!r} with {v} virtual stage(s) per rank",
            hint="interleaved-1f1b and zero-bubble need >= 2 virtual stages, gpipe and 1f1b exactly 1",
        )
    if schedule == "1f1b" and m < pp:
        raise ConfigError(f"1f1b needs at least pp={pp} micro-batches, got {m}", hint=f"use {pp} or more chunks")
    orders = []
    for rank in range(pp):
        if schedule == "gpipe":
            actions = _gpipe(rank, m)
        elif schedule == "1f1b":
            actions = _one_f_one_b(rank, pp, m)
        else:
            actions = _interleaved(rank, pp, v, m, zero_bubble=schedule == "zero-bubble")
        orders.append(_with_reduce(actions, m))
    return orders
