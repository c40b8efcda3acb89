"""Play a schedule's order of actions on per-stage costs: finish times, step span, bubble and activation peaks.

Pure code. Each rank runs its actions strictly in the given order (as torch's schedules do); an action
starts when its rank is free and its inputs have arrived:

- F(s, i) needs F(s-1, i) plus the transfer of stage s-1's output when s-1 is on another rank (a rank holds
  the stages its order runs: looped or V placement alike; V's hop from stage pp-1 to pp costs nothing);
- B or I(s, i) needs F(s, i) and, below the last stage, the backward of (s+1, i) plus the transfer of the
  gradient (same bytes as the activation);
- a transfer out of a fused action (DualPipeV's OVERLAP_F_B: a forward run with the next backward) starts
  when the pair ends, as torch posts its sends after both; each half of such a pair runs shorter by the
  exchange the other half's compute hides (`StageCost.exchange_*_s`, plan/overlap.py);
- a transfer starts when its data is ready, the receiving rank has reached the action that needs it (torch
  posts each receive there, and point-to-point data moves once the receive is posted, as steps measured across
  a throttled gloo link show: the transfer does not overlap the receiver's earlier work) and the link is free (one transfer at a
  time between two ranks in each direction). On a slow link, inter-node, this is the step's cost; on a fast
  one (transfers of a fraction of a millisecond) it changes nothing;
- W(s, i) needs I(s, i); R(s) (gradient reduction) needs the stage's last backward (its place in the order).

Durations: F = forward; B = backward (+ forward again for a micro-batch that recomputes); I and W split the
backward by `weight_share`; every compute action pays `overhead_s` (host-side cost of one schedule action).
Ranks on their own devices run these durations as they are; ranks sharing CPU cores slow down while several
compute at once (`speeds`: processor sharing, simulated event by event). Memory: F adds the micro-batch's held
activations (the stage input only when it recomputes) and its kept output, B (or W under zero-bubble) frees the
activations; while a recomputing backward runs, its activations exist again; as any backward starts, the stage's
`transient_bytes` exist beside what is held (the loss backward's temporaries); the kept outputs stay to the step's
end, where they are merged (held twice).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipetrain.errors import ConfigError
from pipetrain.plan.overlap import hidden_s
from pipetrain.plan.schedules import Action

__all__ = ["StageCost", "Timeline", "simulate", "recomputed_microbatches", "RECOMPUTE_POLICIES", "clear_cache"]

RECOMPUTE_POLICIES = ("never", "except_last", "always")


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


@dataclass(frozen=True)
class Timeline:
    """The simulated step: `span_s` until the last action ends, per-rank busy time and activation peaks."""

    span_s: float
    compute_span_s: float
    busy_s: tuple[float, ...]
    bubble: float
    peak_activation_bytes: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    #: per rank, the peak while the schedule runs (its actions; `peak_activation_bytes` is the larger of this and
    #: the step's end, the kept outputs twice) and the kept outputs held when the last action is done
    running_bytes: tuple[float, ...] = ()
    kept_bytes: tuple[float, ...] = ()


def recomputed_microbatches(policy: str, count: int) -> frozenset[int]:
    """The micro-batches that recompute their activations in backward (pipetrain's checkpoint policies)."""
    if policy == "never":
        return frozenset()
    if policy == "always":
        return frozenset(range(count))
    if policy == "except_last":
        return frozenset(range(count - 1))
    raise ConfigError(f"unknown checkpoint policy {policy!r}", hint=f"choose one of: {', '.join(RECOMPUTE_POLICIES)}")


_KINDS = {"F": 0, "B": 1, "I": 2, "W": 3, "R": 4}


@lru_cache(maxsize=1024)
def _compile(order: tuple[tuple[Action, ...], ...]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Each action as (stage, kind code, microbatch, its slot, its dependency's slot or -1, the stage whose
    transfer delays it or -1, the link (sending rank, receiving rank) that transfer takes as an index or -1, the
    other stage of its fused pair or -1),
    the dependencies of the module docstring resolved once per order. Stages
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
    _compile.cache_clear()


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


def _memory(program, costs: Sequence[StageCost],
            recomputed: Collection[int]) -> tuple[list[float], list[int], list[float], list[float]]:
    """Each rank's peak activation bytes and micro-batches held: they depend on the order only, not on time.
    A micro-batch's activations go with its full backward (B) or its weight backward (W, after an I); a stage's
    `transient_bytes` exist as its backward (B or I) starts. Also each rank's peak while its actions run and the
    kept outputs it holds at the step's end."""
    peaks, inflights, running, ends = [], [], [], []
    for rows in program:
        live = peak = outputs = 0.0  # outputs: what the rank's forwards keep until the step ends
        inflight = peak_inflight = 0
        for stage, kind, mb, *_ in rows:
            cost = costs[stage]
            again = mb in recomputed
            kept = cost.input_bytes if cost.held_bytes is None else cost.held_bytes
            held = kept if again else cost.activation_bytes
            if kind == 0:
                live += held
                outputs += cost.kept_bytes
                inflight += 1
            elif kind in (1, 2):
                peak = max(peak, live + outputs + cost.transient_bytes)
                if again:
                    peak = max(peak, live + outputs - held + (cost.activation_bytes if cost.recompute_bytes is None
                                                              else cost.recompute_bytes))
            peak, peak_inflight = max(peak, live + outputs), max(peak_inflight, inflight)
            if kind in (1, 3):
                live -= held
                inflight -= 1
        peaks.append(max(peak, 2 * outputs))  # the step's end: the kept outputs and their merged copy
        inflights.append(peak_inflight)
        running.append(peak)
        ends.append(outputs)
    return peaks, inflights, running, ends


def _dedicated(program, costs, recomputed, overhead_s) -> tuple[list[float], list[float], float]:
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


def _shared(program, costs, recomputed, overhead_s, speeds: Sequence[float]) -> tuple[list[float], list[float], float]:
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


def simulate(
    order: Sequence[Sequence[Action]],
    costs: Sequence[StageCost],
    *,
    recomputed: Collection[int] = frozenset(),
    overhead_s: float = 0.0,
    speeds: Sequence[float] = (),
) -> Timeline:
    """Run `order` (one action list per rank, from `schedule_order`) on `costs` (one per stage).

    `speeds[n - 1]`: the fraction of its full speed each rank computes at while n ranks compute at once
    (ranks sharing CPU cores); empty or all 1: every rank has its own device."""
    program = _compile(tuple(tuple(Action(*a) for a in actions) for actions in order))
    pp = len(program)
    if any(speed != 1.0 for speed in speeds[:pp]):
        clock, busy, compute_end = _shared(program, costs, recomputed, overhead_s, speeds)
    else:
        clock, busy, compute_end = _dedicated(program, costs, recomputed, overhead_s)
    peak, peak_inflight, running, ends = _memory(program, costs, recomputed)
    span = max(clock)
    bubble = 1.0 - sum(busy) / (pp * compute_end) if compute_end > 0 else 0.0
    return Timeline(span, compute_end, tuple(busy), bubble, tuple(peak), tuple(peak_inflight), tuple(running),
                    tuple(ends))
