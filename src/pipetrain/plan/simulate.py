"""Play a schedule's order of actions on per-stage costs: finish times, step span, bubble and activation peaks.

Pure code. Each rank runs its actions strictly in the given order (as torch's schedules do); an action
starts when its rank is free and its inputs have arrived:

- F(s, i) needs F(s-1, i) plus the transfer of stage s-1's output when s-1 is on another rank;
- B or I(s, i) needs F(s, i) and, below the last stage, the backward of (s+1, i) plus the transfer of the
  gradient (same bytes as the activation);
- W(s, i) needs I(s, i); R(s) (gradient reduction) needs the stage's last backward (its place in the order).

Durations: F = forward; B = backward (+ forward again for a micro-batch that recomputes); I and W split the
backward by `weight_share`; every compute action pays `overhead_s` (host-side cost of one schedule
action). Memory: F adds the micro-batch's held activations (the stage input only when it recomputes), B
(or W under zero-bubble) frees them; while a recomputing backward runs, its activations exist again.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipetrain.errors import ConfigError
from pipetrain.plan.schedules import Action, stage_rank

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


@dataclass(frozen=True)
class Timeline:
    """The simulated step: `span_s` until the last action ends, per-rank busy time and activation peaks."""

    span_s: float
    compute_span_s: float
    busy_s: tuple[float, ...]
    bubble: float
    peak_activation_bytes: tuple[float, ...]
    peak_inflight: tuple[int, ...]


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
def _compile(order: tuple[tuple[Action, ...], ...]) -> tuple[tuple[tuple[int, int, int, int, int, int], ...], ...]:
    """Each action as (stage, kind code, microbatch, its slot, its dependency's slot or -1, the stage whose
    transfer delays it or -1), the dependencies of the module docstring resolved once per order."""
    pp = len(order)
    slots = {tuple(a): i for i, a in enumerate(a for actions in order for a in actions)}
    last = max(a.stage for actions in order for a in actions)
    backward = "I" if any(a.kind == "I" for a in order[0]) else "B"
    compiled = []
    for actions in order:
        rows = []
        for stage, kind, mb in actions:
            dep, hop = -1, -1
            if kind == "F" and stage > 0:
                dep, hop = slots[(stage - 1, "F", mb)], stage - 1
            elif kind in ("B", "I"):
                if stage == last:
                    dep = slots[(stage, "F", mb)]
                else:
                    dep, hop = slots[(stage + 1, backward, mb)], stage
            if hop >= 0 and stage_rank(hop, pp) == stage_rank(hop + 1, pp):
                hop = -1
            rows.append((stage, _KINDS[kind], mb, slots[(stage, kind, mb)], dep, hop))
        compiled.append(tuple(rows))
    return tuple(compiled)


def clear_cache() -> None:
    """Forget the compiled orders."""
    _compile.cache_clear()


def simulate(
    order: Sequence[Sequence[Action]],
    costs: Sequence[StageCost],
    *,
    recomputed: Collection[int] = frozenset(),
    overhead_s: float = 0.0,
) -> Timeline:
    """Run `order` (one action list per rank, from `schedule_order`) on `costs` (one per stage)."""
    program = _compile(tuple(tuple(Action(*a) for a in actions) for actions in order))
    pp = len(program)
    done = [-1.0] * sum(len(rows) for rows in program)
    send = [c.send_s for c in costs]
    clock, busy = [0.0] * pp, [0.0] * pp
    live, peak, inflight, peak_inflight = [0.0] * pp, [0.0] * pp, [0] * pp, [0] * pp
    compute_end = 0.0
    position = [0] * pp
    remaining = len(done)
    frees_at = 3 if any(row[1] == 3 for row in program[0]) else 1
    while remaining:
        progressed = False
        for rank, rows in enumerate(program):
            at = position[rank]
            while at < len(rows):
                stage, kind, mb, slot, dep, hop = rows[at]
                ready = 0.0
                if dep >= 0:
                    ready = done[dep]
                    if ready < 0.0:
                        break
                    if hop >= 0:
                        ready += send[hop]
                cost = costs[stage]
                again = mb in recomputed
                held = cost.input_bytes if again else cost.activation_bytes
                if kind == 0:
                    duration = cost.forward_s + overhead_s
                    live[rank] += held
                    inflight[rank] += 1
                elif kind == 4:
                    duration = cost.reduce_s
                else:
                    share = 1.0 if kind == 1 else (1.0 - cost.weight_share if kind == 2 else cost.weight_share)
                    duration = cost.backward_s * share + overhead_s
                    if again and kind != 3:
                        duration += cost.forward_s
                        peak[rank] = max(peak[rank], live[rank] - held + cost.activation_bytes)
                if live[rank] > peak[rank]:
                    peak[rank] = live[rank]
                if inflight[rank] > peak_inflight[rank]:
                    peak_inflight[rank] = inflight[rank]
                if kind == frees_at:
                    live[rank] -= held
                    inflight[rank] -= 1
                end_s = (clock[rank] if clock[rank] > ready else ready) + duration
                clock[rank] = end_s
                done[slot] = end_s
                if kind != 4:
                    busy[rank] += duration
                    if end_s > compute_end:
                        compute_end = end_s
                at += 1
                remaining -= 1
                progressed = True
            position[rank] = at
        if not progressed:
            raise ConfigError("the schedule's order deadlocks (an action waits for one that never runs)",
                              hint="this is a bug in the order generator; report the schedule and sizes")
    span = max(clock)
    bubble = 1.0 - sum(busy) / (pp * compute_end) if compute_end > 0 else 0.0
    return Timeline(span, compute_end, tuple(busy), bubble, tuple(peak), tuple(peak_inflight))
