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

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pipetrain.errors import ConfigError
from pipetrain.plan.events import StageCost, clear_cache, compile_order, dedicated_times, shared_times
from pipetrain.plan.schedules import Action

# the event model (`StageCost`, the actions' start and end times) lives in plan/events.py; its names stay importable
# from here, the times' helpers under their old names too
__all__ = ["StageCost", "Timeline", "simulate", "recomputed_microbatches", "RECOMPUTE_POLICIES", "clear_cache"]
_compile, _dedicated, _shared = compile_order, dedicated_times, shared_times

RECOMPUTE_POLICIES = ("never", "except_last", "always")


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
    program = compile_order(tuple(tuple(Action(*a) for a in actions) for actions in order))
    pp = len(program)
    if any(speed != 1.0 for speed in speeds[:pp]):
        clock, busy, compute_end = shared_times(program, costs, recomputed, overhead_s, speeds)
    else:
        clock, busy, compute_end = dedicated_times(program, costs, recomputed, overhead_s)
    peak, peak_inflight, running, ends = _memory(program, costs, recomputed)
    span = max(clock)
    bubble = 1.0 - sum(busy) / (pp * compute_end) if compute_end > 0 else 0.0
    return Timeline(span, compute_end, tuple(busy), bubble, tuple(peak), tuple(peak_inflight), tuple(running),
                    tuple(ends))
