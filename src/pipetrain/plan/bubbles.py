"""The simulated bubble of each schedule on equal stages, as a table (pure code; `python benchmarks/bubble_table.py`).

The model's work is split evenly over the `pp * v` stages of each schedule (v = stages per rank), with a
forward of 1 and a backward of 2 per rank and micro-batch (so F = I = W within a stage), no transfers and
no host overhead: what the schedule's order alone costs. `bubble` is the simulator's fraction (idle over
ranks x compute span), `step` the compute span relative to 1F1B's on the same pp and micro-batches,
`peak` the most activations a rank holds at once, in micro-batches of the rank's whole share of the model
(1F1B's first rank: pp). With `--calibration FILE` it prints instead the planner's full predictions
(`predict`: measured device, host cost per action, transfers, shared CPU cores) for the block costs given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.plan.hardware import load_calibration
from pipetrain.plan.model import BlockCost
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.schedules import V_SCHEDULES, min_microbatches, schedule_order
from pipetrain.plan.simulate import StageCost, simulate

__all__ = ["BubbleRow", "bubble_rows", "markdown", "predicted_markdown"]

SCHEDULES = (("1f1b", 1), ("zero-bubble", 2), ("zbv", 2), ("dualpipev", 2))


@dataclass(frozen=True)
class BubbleRow:
    """One schedule at one size: simulated bubble fraction, compute span, peak activations of the busiest
    rank (in micro-batches of a rank's whole share of the model)."""

    schedule: str
    pp: int
    chunks: int
    bubble: float
    span: float
    peak_activations: float


def bubble_rows(pps: Sequence[int] = (2, 4), per_rank: Sequence[int] = (2, 4, 8),
                schedules: Sequence[tuple[str, int]] = SCHEDULES) -> list[BubbleRow]:
    """Rows for every pp and micro-batch count `k * pp` (k in `per_rank`) each schedule accepts."""
    rows = []
    for pp in pps:
        for k in per_rank:
            m = k * pp
            for schedule, v in schedules:
                if m < min_microbatches(schedule, pp) or (v > 1 and schedule not in V_SCHEDULES and m % pp):
                    continue
                costs = [StageCost(forward_s=1.0 / v, backward_s=2.0 / v, activation_bytes=1.0 / v)] * (pp * v)
                timeline = simulate(schedule_order(schedule, pp, m, v), costs)
                rows.append(BubbleRow(schedule, pp, m, timeline.bubble, timeline.compute_span_s,
                                      max(timeline.peak_activation_bytes)))
    return rows


def markdown(rows: Sequence[BubbleRow]) -> str:
    """The rows as a markdown table (step time relative to 1F1B at the same pp and micro-batches)."""
    base = {(r.pp, r.chunks): r.span for r in rows if r.schedule == "1f1b"}
    lines = ["| pp | micro-batches | schedule | bubble | step vs 1F1B | peak activations (micro-batches) |",
             "|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r.span / base[r.pp, r.chunks]:.3f}" if (r.pp, r.chunks) in base else "-"
        lines.append(f"| {r.pp} | {r.chunks} | {r.schedule} | {100 * r.bubble:.1f} % | {ratio} "
                     f"| {r.peak_activations:g} |")
    return "\n".join(lines)


def predicted_markdown(calibration: str, blocks: Sequence[BlockCost], batch: int, pps: Sequence[int],
                       per_rank: Sequence[int]) -> str:
    """The planner's predicted step time and bubble of each schedule for a model of these block costs (dp 1)."""
    calib = load_calibration(calibration)
    lines = ["| pp | micro-batches | schedule | predicted step s | vs 1F1B | predicted bubble |",
             "|---:|---:|---|---:|---:|---:|"]
    for pp in pps:
        for k in per_rank:
            m, base = k * pp, None
            for schedule, v in SCHEDULES:
                if m < min_microbatches(schedule, pp) or batch % m:
                    continue
                p = predict(blocks, Layout(dp=1, pp=pp, batch=batch, chunks=m, schedule=schedule, virtual=v),
                            calib.device, calib.network)
                base = base or p.step_s
                lines.append(f"| {pp} | {m} | {schedule} | {p.step_s:.3f} | {p.step_s / base:.2f} | "
                             f"{100 * p.bubble:.0f} % |")
    return "\n".join(lines)


if __name__ == "__main__":  # this module printed the table before 0.2
    raise SystemExit("error: the table moved: run `python benchmarks/bubble_table.py` (same options)")
