"""The simulator's event model: a stage's costs, and when each action of an order starts and ends on ranks with
their own devices or sharing CPU cores (the dependencies and durations of `plan.simulate`'s docstring)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipetrain.errors import ConfigError
from pipetrain.plan.overlap import hidden_s
from pipetrain.plan.schedules import Action

__all__ = ["StageCost", "compile_order", "clear_cache", "dedicated_times", "shared_times"]


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """What one stage costs per micro-batch. Seconds; bytes."""

    forward_s: float
    backward_s: float
    activation_bytes: float = 0.0
    input_bytes: float = 0.0
    send_s: float = 0.0
    reduce_s: float = 0.0
    weight_share: float = 0.5
    #: bytes a recomputing micro-batch keeps from its forward to its backward (None: `input_bytes`, the stage's
    #: input: the whole stage is recomputed), and the bytes it holds while its backward runs (None:
    #: `activation_bytes`, every block's activations at once)
    held_bytes: float | None = None
    recompute_bytes: float | None = None
    #: seconds a recomputing micro-batch's backward runs again (None: `forward_s`, the whole forward)
    recompute_s: float | None = None
    #: bytes each forward leaves held until the step ends, then merged into one more copy (the last stage's outputs,
    #: which the schedule keeps for the step's merged output: plan/loss.py)
    kept_bytes: float = 0.0
    #: bytes alive for a moment as each backward of the stage starts, beside what its micro-batch holds (the last
    #: stage's loss backward: its logits-sized temporaries, plan/loss.py)
    transient_bytes: float = 0.0
    #: the experts' all-to-all seconds within `forward_s` and `backward_s` that a fused forward-and-backward pair
    #: hides behind its other half's compute (`--moe-overlap on`, plan/overlap.py; 0: nothing hidden)
    exchange_forward_s: float = 0.0
    exchange_backward_s: float = 0.0


_KINDS = {"F": 0, "B": 1, "I": 2, "W": 3, "R": 4}


@lru_cache(maxsize=1024)
def compile_order(order: tuple[tuple[Action, ...], ...]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Each action as (stage, kind code, microbatch, its slot, its dependency's slot or -1, the stage whose
    transfer delays it or -1, the link (sending rank, receiving rank) that transfer takes as an index or -1, the
    other stage of its fused pair or -1), the dependencies of `plan.simulate`'s docstring resolved once per order. Stages
    are placed where the order runs them; a dependency on another rank's fused action (DualPipeV's
    OVERLAP_F_B) waits for the end of the pair, when torch posts the send."""
    slots, leaves, rank_of = {}, [], {}
    for rank, actions in enumerate(order):
        for at, action in enumerate(actions):
            slots[tuple(action[:3])] = len(leaves)
            leaves.append(len(leaves) + 1 if action.fused and at + 1 < len(actions) else len(leaves))
            rank_of.setdefault(action.stage, rank)
    last = max(rank_of)
    links: dict[tuple[int, int], int] = {}
    compiled = []
    for actions in order:
        rows = []
        for stage, kind, mb, *_ in actions:
            dep, hop = -1, -1
            if kind == "F" and stage > 0:
                dep, hop = slots[(stage - 1, "F", mb)], stage - 1
            elif kind in ("B", "I"):
                if stage == last:
                    dep = slots[(stage, "F", mb)]
                else:
                    after = slots.get((stage + 1, "I", mb))
                    dep, hop = (slots[(stage + 1, "B", mb)] if after is None else after), stage
            link = -1
            if hop >= 0 and rank_of[hop] == rank_of[hop + 1]:
                hop = -1
            elif hop >= 0:
                dep = leaves[dep]
                ends = (rank_of[hop], rank_of[hop + 1]) if kind == "F" else (rank_of[hop + 1], rank_of[hop])
                link = links.setdefault(ends, len(links))
            rows.append((stage, _KINDS[kind], mb, slots[(stage, kind, mb)], dep, hop, link, -1))
        for at in range(len(actions) - 1):  # a fused pair: each half's partner stage (plan/overlap.py)
            if actions[at].fused:
                rows[at] = rows[at][:7] + (actions[at + 1].stage,)
                rows[at + 1] = rows[at + 1][:7] + (actions[at].stage,)
        compiled.append(tuple(rows))
    return tuple(compiled)


def clear_cache() -> None:
    """Forget the compiled orders."""
    compile_order.cache_clear()


def _arrival(row: tuple[int, ...], done: list[float], send: list[float], link_free: dict[int, float],
             arrived: dict[int, float], posted: float) -> float:
    """When the input of `row` (its dependency's output, sent over its link) has arrived: computed once per
    action; the transfer starts at the latest of the data's readiness, the receive's posting (`posted`: when the
    receiving rank reached `row`) and the link's previous transfer's arrival."""
    slot = row[3]
    if slot not in arrived:
        start = max(done[row[4]], posted, link_free.get(row[6], 0.0))
        arrived[slot] = link_free[row[6]] = start + send[row[5]]
    return arrived[slot]


def _duration(row: tuple[int, ...], costs: Sequence[StageCost], recomputed: Collection[int],
              overhead_s: float) -> float:
    stage, kind, mb = row[0], row[1], row[2]
    cost = costs[stage]
    hidden = hidden_s(cost, costs[row[7]], forward=kind == 0) if row[7] >= 0 else 0.0  # a fused pair's half
    if kind == 0:
        return cost.forward_s - hidden + overhead_s
    if kind == 4:
        return cost.reduce_s
    share = 1.0 if kind == 1 else (1.0 - cost.weight_share if kind == 2 else cost.weight_share)
    redo = cost.forward_s if cost.recompute_s is None else cost.recompute_s
    again = redo if mb in recomputed and kind != 3 else 0.0
    return cost.backward_s * share - hidden + overhead_s + again


def dedicated_times(program, costs, recomputed, overhead_s) -> tuple[list[float], list[float], float]:
    """Finish times when every rank has its own device: list scheduling in the ranks' order."""
    pp = len(program)
    done = [-1.0] * sum(len(rows) for rows in program)
    send = [c.send_s for c in costs]
    clock, busy = [0.0] * pp, [0.0] * pp
    link_free: dict[int, float] = {}
    arrived: dict[int, float] = {}
    compute_end = 0.0
    position = [0] * pp
    remaining = len(done)
    while remaining:
        progressed = False
        for rank, rows in enumerate(program):
            at = position[rank]
            while at < len(rows):
                row = rows[at]
                dep, hop = row[4], row[5]
                ready = 0.0
                if dep >= 0:
                    ready = done[dep]
                    if ready < 0.0:
                        break
                    if hop >= 0:
                        ready = _arrival(row, done, send, link_free, arrived, clock[rank])
                duration = _duration(row, costs, recomputed, overhead_s)
                end_s = (clock[rank] if clock[rank] > ready else ready) + duration
                clock[rank] = done[row[3]] = end_s
                if row[1] != 4:
                    busy[rank] += duration
                    compute_end = max(compute_end, end_s)
                at += 1
                remaining -= 1
                progressed = True
            position[rank] = at
        if not progressed:
            _deadlock()
    return clock, busy, compute_end


def shared_times(program, costs, recomputed, overhead_s,
                 speeds: Sequence[float]) -> tuple[list[float], list[float], float]:
    """Finish times when ranks share the processors: while n ranks compute at once, each advances at
    `speeds[n - 1]` of its full speed (events in time order; transfers and reductions take no processor)."""
    pp = len(program)
    done = [-1.0] * sum(len(rows) for rows in program)
    send = [c.send_s for c in costs]
    position, free, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    left: list[float | None] = [None] * pp
    link_free: dict[int, float] = {}
    arrived: dict[int, float] = {}
    now, compute_end, remaining = 0.0, 0.0, len(done)
    while remaining:
        ready = [math.inf] * pp
        for rank, rows in enumerate(program):
            if position[rank] == len(rows):
                continue
            row = rows[position[rank]]
            if left[rank] is not None:
                ready[rank] = now
            elif row[4] < 0:
                ready[rank] = free[rank]
            elif done[row[4]] >= 0.0:
                arrival = _arrival(row, done, send, link_free, arrived, free[rank]) if row[5] >= 0 else done[row[4]]
                ready[rank] = max(free[rank], arrival)
        running = [rank for rank in range(pp) if ready[rank] <= now]
        if not running:
            now = min(ready)
            if now == math.inf:
                _deadlock()
            continue
        computing = sum(1 for rank in running if program[rank][position[rank]][1] != 4)
        rate = speeds[min(computing, len(speeds)) - 1] if computing else 1.0
        finish = {}
        for rank in running:
            row = program[rank][position[rank]]
            if left[rank] is None:  # the action starts: all of its work is still ahead
                left[rank] = _duration(row, costs, recomputed, overhead_s)
                if row[1] != 4:
                    busy[rank] += left[rank]
            finish[rank] = now + left[rank] / (1.0 if row[1] == 4 else rate)
        step_to = min(min(finish.values()), min((t for t in ready if t > now), default=math.inf))
        for rank in running:
            row = program[rank][position[rank]]
            if finish[rank] <= step_to * (1 + 1e-12):
                done[row[3]] = free[rank] = step_to
                if row[1] != 4:
                    compute_end = max(compute_end, step_to)
                left[rank] = None
                position[rank] += 1
                remaining -= 1
            else:
                left[rank] -= (step_to - now) * (1.0 if row[1] == 4 else rate)
        now = step_to
    return free, busy, compute_end


def _deadlock() -> None:
    raise ConfigError("the schedule's order deadlocks (an action waits for one that never runs)",
                      hint="this is a bug in the order generator; report the schedule and sizes")
