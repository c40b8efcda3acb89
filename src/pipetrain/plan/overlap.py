"""DualPipeV's overlapped forward-and-backward pairs in the planner (`--moe-overlap on`; pure).

torch's DualPipeV fuses a forward of one stage with the backward of the other (OVERLAP_F_B); under `--moe-overlap
on` pipetrain runs the two halves in two threads, so one micro-batch's experts' all-to-alls can run while the other
computes. The planner prices that pair as DeepSeek's DualPipe argument does, per side: the forward's exchange shows
only beyond the backward's compute, max(0, X_F - C_B), and the backward's beyond the forward's, max(0, X_B - C_F),
where X is a stage's all-to-all seconds (`experts.ep_exchange_s`, summed over its MoE blocks) and C the rest of its
time. Unfused actions (warm-up, cool-down) pay their exchange whole.

The rule for a device whose ranks share CPU cores (`Device.cores` > 0, gloo on the same cores): nothing is hidden.
gloo's all-to-all runs in the calling thread on the same cores as the other half's compute, and the ranks of a node
already keep every core busy, so the exchange takes core time from the compute instead of idle time beside it
(`benchmarks/moe_ep.py` prints it beside the plan, docs/planning.md: in four runs of five the overlapped step was
slower; the second thread's own cost, 12-63 % of the step in five runs, is not priced: docs/planning.md says why).
A GPU (`cores` 0) runs its collectives on their own stream, beside the compute.
"""

from __future__ import annotations

from typing import Protocol

from pipetrain.plan.hardware import Device

__all__ = ["OVERLAP_SCHEDULES", "can_overlap", "overlap_hides", "hidden_s"]

#: the schedules whose order fuses a forward with a backward (torch's OVERLAP_F_B)
OVERLAP_SCHEDULES = ("dualpipev",)


class _Costs(Protocol):
    forward_s: float
    backward_s: float
    exchange_forward_s: float
    exchange_backward_s: float


class _Layout(Protocol):
    schedule: str
    ep: int


def can_overlap(layout: _Layout) -> bool:
    """Whether `--moe-overlap on` applies to `layout` (as train allows it: DualPipeV with the experts split)."""
    return layout.schedule in OVERLAP_SCHEDULES and layout.ep > 1


def overlap_hides(device: Device) -> bool:
    """Whether an overlapped pair hides any exchange on `device` (not where compute and gloo share CPU cores)."""
    return not device.cores


def hidden_s(own: _Costs, other: _Costs, forward: bool) -> float:
    """Seconds of `own`'s exchange (its forward's when `forward`, else its backward's) that the other half of a
    fused pair hides: min(X, C) of the other half's compute C (the exposed rest, X - min(X, C), stays)."""
    exchange = own.exchange_forward_s if forward else own.exchange_backward_s
    if exchange <= 0.0:
        return 0.0
    compute = other.backward_s - other.exchange_backward_s if forward else other.forward_s - other.exchange_forward_s
    return min(exchange, max(0.0, compute))
