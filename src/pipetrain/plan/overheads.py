"""The fixed costs of a step that no model size sets, fitted from two measured pipeline steps (pure arithmetic).

A step of a small model is mostly host work: each schedule action's Python, dispatch and transfer posting
(`Device.action_overhead_s`, paid by every forward and backward the simulator plays, so by those on the critical
path) and, once per step, what the engine does around the schedule: splitting the batch, the loss's global count,
the step's metrics reduced and read back, the gradients zeroed (`Device.step_overhead_s`, added once to the step by
`plan.predict`). The calibration times one 2-stage GPipe of the same layers with 1 and with 16 micro-batches and
simulates both without overheads (`span_s`: the compute and transfers at the measured rates); with `actions` the
number of overhead-paying actions on each one's critical path (the simulator's span at 1 s per action less its span
at 0), the two steps give the two unknowns:

    measured(c) = span(c) + actions(c) · action_overhead_s + step_overhead_s,  c = 1, 16.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.errors import ConfigError

__all__ = ["StepSample", "fit_overheads"]


@dataclass(frozen=True)
class StepSample:
    """One measured step: its seconds, the simulated seconds without overheads, and the actions on its critical
    path (how many times a per-action cost adds to the span)."""

    measured_s: float
    span_s: float
    actions: float


def fit_overheads(few: StepSample, many: StepSample) -> tuple[float, float]:
    """(seconds per schedule action, seconds per step) that make both samples' spans their measured seconds; each
    clamped at 0 (a noisy measurement can ask for a negative cost: the other one then takes all of the excess)."""
    if many.actions == few.actions:
        raise ConfigError(f"both steps have {few.actions} actions on their critical path: no per-action cost to fit",
                          hint="measure two steps with different micro-batch counts")
    per_action = ((many.measured_s - many.span_s) - (few.measured_s - few.span_s)) / (many.actions - few.actions)
    if per_action < 0:
        return 0.0, max(0.0, min(few.measured_s - few.span_s, many.measured_s - many.span_s))
    per_step = few.measured_s - few.span_s - few.actions * per_action
    if per_step < 0:
        return max(0.0, (many.measured_s - many.span_s) / many.actions), 0.0
    return per_action, per_step
