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

from pipetrain.errors import ConfigError
from pipetrain.plan.schedules import Action, stage_rank

__all__ = ["StageCost", "Timeline", "simulate", "recomputed_microbatches", "RECOMPUTE_POLICIES"]

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


def _ready(action: Action, done: dict[tuple[int, str, int], float], costs: Sequence[StageCost], pp: int) -> float | None:
    """When `action`'s inputs are available, or None if a predecessor has not run yet."""
    stage, kind, mb = action
    if kind == "F":
        if stage == 0:
            return 0.0
        end = done.get((stage - 1, "F", mb))
        if end is None:
            return None
        return end + (costs[stage - 1].send_s if stage_rank(stage - 1, pp) != stage_rank(stage, pp) else 0.0)
    if kind in ("B", "I"):
        if stage == len(costs) - 1:
            return done.get((stage, "F", mb))
        end = done.get((stage + 1, "B", mb), done.get((stage + 1, "I", mb)))
        if end is None:
            return None
        return end + (costs[stage].send_s if stage_rank(stage + 1, pp) != stage_rank(stage, pp) else 0.0)
    return 0.0  # W and R follow their prerequisites on the same rank, in order


def simulate(
    order: Sequence[Sequence[Action]],
    costs: Sequence[StageCost],
    *,
    recomputed: Collection[int] = frozenset(),
    overhead_s: float = 0.0,
) -> Timeline:
    """Run `order` (one action list per rank, from `schedule_order`) on `costs` (one per stage)."""
    pp = len(order)
    done: dict[tuple[int, str, int], float] = {}
    clock, busy = [0.0] * pp, [0.0] * pp
    live, peak, inflight, peak_inflight = [0.0] * pp, [0.0] * pp, [0] * pp, [0] * pp
    compute_end = 0.0
    position = [0] * pp
    remaining = sum(len(actions) for actions in order)
    frees_at = "W" if any(a.kind == "W" for a in order[0]) else "B"
    while remaining:
        progressed = False
        for rank, actions in enumerate(order):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                ready = _ready(action, done, costs, pp)
                if ready is None:
                    break
                stage, kind, mb = action
                cost = costs[stage]
                again = mb in recomputed
                held = cost.input_bytes if again else cost.activation_bytes
                if kind == "F":
                    duration = cost.forward_s + overhead_s
                    live[rank] += held
                    inflight[rank] += 1
                elif kind == "R":
                    duration = cost.reduce_s
                else:
                    share = {"B": 1.0, "I": 1.0 - cost.weight_share, "W": cost.weight_share}[kind]
                    duration = cost.backward_s * share + overhead_s + (cost.forward_s if again and kind != "W" else 0.0)
                    if again and kind != "W":
                        peak[rank] = max(peak[rank], live[rank] - held + cost.activation_bytes)
                peak[rank] = max(peak[rank], live[rank])
                peak_inflight[rank] = max(peak_inflight[rank], inflight[rank])
                if kind == frees_at:
                    live[rank] -= held
                    inflight[rank] -= 1
                start = max(clock[rank], ready)
                clock[rank] = start + duration
                done[(stage, kind, mb)] = clock[rank]
                if kind != "R":
                    busy[rank] += duration
                    compute_end = max(compute_end, clock[rank])
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ConfigError("the schedule's order deadlocks (an action waits for one that never runs)",
                              hint="this is a bug in the order generator; report the schedule and sizes")
    span = max(clock)
    bubble = 1.0 - sum(busy) / (pp * compute_end) if compute_end > 0 else 0.0
    return Timeline(span, compute_end, tuple(busy), bubble, tuple(peak), tuple(peak_inflight))
