"""The order of actions each pipeline rank runs, generated in pure code for every schedule pipetrain supports.

A schedule is, per rank, a list of actions `(stage, kind, microbatch)` with kind "F" (forward), "B" (full
backward), "I" (backward for the input only), "W" (backward for the weights only) and "R" (the stage's
gradient reduction over data-parallel replicas, placed after its last backward-like action, with
`microbatch` -1). An action with `fused` set runs as one unit with the next one (torch's OVERLAP_F_B of
DualPipeV: a forward and a backward whose sends are posted when both are done). The orders are those of
torch 2.13's `torch.distributed.pipelining` schedules, idle slots removed; `tests/unit/test_plan_schedules.py`
checks them against torch's own (through `pipetrain.compat.pipelining`) for a table of sizes.

Placement (`stage_rank`): looped (stage s on rank s % pp) for every schedule but the V-shaped ones, where
rank r holds stages r and 2pp-1-r (the hop from stage pp-1 to pp stays on one rank).

- gpipe: every forward, then every backward, micro-batches in order.
- 1f1b: `pp - 1 - rank` warm-up forwards, then alternate one forward and one backward, then drain.
- interleaved-1f1b (Narayanan et al. 2021), zero-bubble (ZB1P of Qi et al. 2024): depth-first over the
  rank's `v` stages in rounds of `m // max(1, m // pp)` micro-batches; zero-bubble splits each backward
  into I then a deferred W.
- zbv (ZB-V, Qi et al. 2024 section 6; torch's `ScheduleZBVZeroBubble`): 2 stages per rank in a V; warm-up
  forwards on the first stage, then F/I/W triples alternating between the rank's two stages, then the
  input backwards and the deferred weight backwards. Any m >= 1 (torch plans for max(m, 2pp-1) and drops
  the micro-batches beyond m).
- dualpipev (DeepSeek's DualPipe, V variant; torch's `ScheduleDualPipeV`): 2 stages per rank in a V; the
  steady state pairs a forward of one stage with a full backward of the other (fused), and the tail splits
  backwards into I and W to fill the drain. torch requires m >= 2pp (odd m are accepted).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from pipetrain.config import SCHEDULES, V_SCHEDULES
from pipetrain.errors import ConfigError

__all__ = ["Action", "schedule_order", "stage_rank", "rank_stages", "placement", "min_microbatches",
           "SIMULATED_SCHEDULES", "V_SCHEDULES", "MULTI_STAGE_SCHEDULES"]

SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
#: Schedules with more than one stage per rank (V_SCHEDULES, from the configuration: exactly 2, in a V).
MULTI_STAGE_SCHEDULES = tuple(name for name, per_rank in SCHEDULES.items() if per_rank > 1)


class Action(NamedTuple):
    """One step of a rank: `kind` of `stage` on `microbatch` (-1 for "R")."""

    stage: int
    kind: str
    microbatch: int
    fused: bool = False


def placement(schedule: str) -> str:
    """"v" for the V-shaped schedules, "loop" for the others."""
    return "v" if schedule in V_SCHEDULES else "loop"


def stage_rank(stage: int, pp: int, style: str = "loop") -> int:
    """The pipeline rank holding `stage`: looped (s % pp) or V-shaped ("v": zig-zag, torch's
    `generate_stage_to_rank_mapping(style="v")`; with 2 stages per rank, s for s < pp, else 2pp-1-s)."""
    if style == "v":
        return stage % pp if (stage // pp) % 2 == 0 else pp - 1 - stage % pp
    if style != "loop":
        raise ConfigError(f"unknown stage placement {style!r}", hint="use 'loop' or 'v'")
    return stage % pp


def rank_stages(rank: int, pp: int, stages_per_rank: int, style: str = "loop") -> list[int]:
    """The stages `rank` holds, in increasing order."""
    return [s for s in range(pp * stages_per_rank) if stage_rank(s, pp, style) == rank]


def min_microbatches(schedule: str, pp: int) -> int:
    """The fewest micro-batches torch 2.13 accepts for `schedule` on `pp` ranks (multiples aside)."""
    if schedule == "1f1b":
        return pp
    if schedule == "dualpipev":
        return 2 * pp
    return 1


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


class _Counter:
    """Next micro-batch per (stage, kind); `take` returns the action and advances."""

    def __init__(self) -> None:
        self.next: dict[tuple[int, str], int] = defaultdict(int)

    def take(self, stage: int, kind: str, fused: bool = False) -> Action:
        index = self.next[stage, kind]
        self.next[stage, kind] = index + 1
        return Action(stage, kind, index, fused)


def _zbv(rank: int, pp: int, m: int) -> list[Action]:
    """ZB-V (torch's `ScheduleZBVZeroBubble._calculate_single_rank_operations`), idle slots dropped."""
    first, second = rank, 2 * pp - 1 - rank
    n = max(2 * pp - 1, m)  # torch plans a full pipeline, then drops the micro-batches beyond m
    c = _Counter()
    out = [c.take(first, "F") for _ in range(2 * (pp - rank) - 1)]
    for _ in range(rank):
        out += [c.take(second, "F"), c.take(first, "F")]
    for _ in range(pp - rank):
        out += [c.take(second, "F"), c.take(second, "I"), c.take(second, "W")]
    while c.next[second, "F"] < c.next[first, "F"] or c.next[first, "F"] < n:
        if c.next[first, "F"] < n:
            out.append(c.take(first, "F"))
        out += [c.take(first, "I"), c.take(first, "W"), c.take(second, "F"), c.take(second, "I"),
                c.take(second, "W")]
    for _ in range(rank):
        out += [c.take(first, "I"), c.take(second, "I")]
    for _ in range(pp - rank):
        out += [c.take(first, "I"), c.take(first, "W")]
    for stage in (second, first):
        while c.next[stage, "W"] < c.next[stage, "I"]:
            out.append(c.take(stage, "W"))
    return [a for a in out if a.microbatch < m]


def _dualpipev(rank: int, pp: int, m: int) -> list[Action]:
    """DualPipeV (torch's `ScheduleDualPipeV._calculate_single_rank_operations`), OVERLAP_F_B as a fused
    forward followed by its full backward."""
    first, second = rank, 2 * pp - 1 - rank
    c = _Counter()
    pending: list[tuple[int, int]] = []  # (stage, micro-batch) whose W is still to run
    out: list[Action] = []

    def backward(stage: int, split: bool) -> Action:
        """A full backward ("B") or an input backward ("I", its W queued); one counter for both, as torch."""
        action = c.take(stage, "I")
        if split:
            pending.append((stage, action.microbatch))
            return action
        return Action(stage, "B", action.microbatch)

    def weight() -> None:
        if pending:
            out.append(Action(pending[0][0], "W", pending.pop(0)[1]))

    def overlap(forward: int, backward_stage: int) -> None:
        out.append(c.take(forward, "F", fused=True))
        out.append(backward(backward_stage, split=False))

    out += [c.take(first, "F") for _ in range(2 * (pp - rank - 1))]
    for _ in range(rank + 1):
        out += [c.take(first, "F"), c.take(second, "F")]
    for _ in range(pp - rank - 1):
        out.append(backward(second, split=True))
        weight()
        out.append(c.take(second, "F"))
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:  # torch does not fuse this pair (a smaller bubble)
            out += [c.take(first, "F"), backward(second, split=False)]
        else:
            overlap(first, second)
        overlap(second, first)
    for _ in range(pp - rank - 1):
        out.append(backward(second, split=False))
        overlap(second, first)
    steps, split = rank + 1, False
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            split = True
        out.append(backward(second, split))
        if i == steps // 2 and rank % 2 == 0:
            split = True
        out.append(backward(first, split))
    for _ in range(pp - rank - 1):
        weight()
        out.append(backward(first, split))
    for _ in range(rank + 1):
        weight()
    return out


def schedule_order(schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The actions of every rank (index = pipeline rank), "R" included, for `schedule` on `pp` ranks."""
    m, v = n_microbatches, virtual_stages
    if schedule not in SIMULATED_SCHEDULES:
        raise ConfigError(f"no simulator for schedule {schedule!r}", hint=f"use one of: {', '.join(SIMULATED_SCHEDULES)}")
    if pp < 1 or m < 1 or v < 1:
        raise ConfigError(f"pp, micro-batches and virtual stages must be >= 1, got {pp}, {m}, {v}", hint="pass positive sizes")
    multi = schedule in MULTI_STAGE_SCHEDULES
    if multi != (v > 1) or (schedule in V_SCHEDULES and v != 2):
        raise ConfigError(
            f"schedule {schedule!r} with {v} virtual stage(s) per rank",
            hint="interleaved-1f1b and zero-bubble need >= 2 virtual stages, zbv and dualpipev exactly 2, "
                 "gpipe and 1f1b exactly 1",
        )
    least = min_microbatches(schedule, pp)
    if m < least:
        raise ConfigError(f"{schedule} needs at least {least} micro-batches on pp={pp}, got {m}",
                          hint=f"use {least} or more chunks")
    orders = []
    for rank in range(pp):
        if schedule == "gpipe":
            actions = _gpipe(rank, m)
        elif schedule == "1f1b":
            actions = _one_f_one_b(rank, pp, m)
        elif schedule == "zbv":
            actions = _zbv(rank, pp, m)
        elif schedule == "dualpipev":
            actions = _dualpipev(rank, pp, m)
        else:
            actions = _interleaved(rank, pp, v, m, zero_bubble=schedule == "zero-bubble")
        orders.append(_with_reduce(actions, m))
    return orders
