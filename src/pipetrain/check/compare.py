"""Tensor records to `StepDiff`s: each block's worst relative gradient and parameter difference, per step.

A record is what one run saw at each step: `{"losses": [float], "grads": [{name: tensor | None}],
"params": [{name: tensor}]}` with parameters named `<block>.<name in block>` (the unsplit model's names,
which `PipelineEngine.named_parameters` also gives, whatever the layout).
"""

from __future__ import annotations

import torch

from pipetrain.check.findings import BlockDiff, StepDiff, relative

__all__ = ["tensor_rel", "step_diffs", "spread"]


def tensor_rel(value: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """`||value - ref|| / ||ref||` in float64; a missing gradient counts as zeros."""
    if value is None and ref is None:
        return 0.0
    ref_ = torch.zeros_like(value) if ref is None else ref
    value_ = torch.zeros_like(ref_) if value is None else value
    if value_.shape != ref_.shape:
        return float("inf")
    a, b = value_.detach().double().cpu(), ref_.detach().double().cpu()
    return relative((a - b).norm().item(), b.norm().item())


def _block(name: str) -> int:
    return int(name.partition(".")[0])


def _worst(per_tensor: dict[str, float]) -> dict[int, tuple[float, str]]:
    worst: dict[int, tuple[float, str]] = {}
    for name, value in per_tensor.items():
        block = _block(name)
        if block not in worst or value > worst[block][0]:
            worst[block] = (value, name)
    return worst


def step_diffs(ref: dict, records: list[dict]) -> list[StepDiff]:
    """Each step's differences of the layout's `records` (one per rank, each holding some parameters; replicas
    hold the same ones and are all compared) against the reference `ref`; the loss is rank 0's."""
    steps = []
    for step, ref_loss in enumerate(ref["losses"]):
        grads: dict[str, float] = {}
        params: dict[str, float] = {}
        for record in records:
            for name, grad in record["grads"][step].items():
                grads[name] = max(grads.get(name, 0.0), tensor_rel(grad, ref["grads"][step][name]))
            for name, value in record["params"][step].items():
                params[name] = max(params.get(name, 0.0), tensor_rel(value, ref["params"][step][name]))
        missing = set(ref["params"][step]) - set(params)
        for name in missing:  # held by no rank: as wrong as can be
            grads[name] = params[name] = float("inf")
        worst_grad, worst_param = _worst(grads), _worst(params)
        blocks = {block: BlockDiff(grad=worst_grad[block][0], grad_tensor=worst_grad[block][1],
                                   param=worst_param[block][0], param_tensor=worst_param[block][1])
                  for block in worst_param}
        steps.append(StepDiff(ref_loss=ref_loss, loss=records[0]["losses"][step], blocks=blocks))
    return steps


def spread(a: dict, b: dict) -> float:
    """The largest relative difference between two records of the same run (losses, gradients, parameters)."""
    worst = 0.0
    for step, loss in enumerate(a["losses"]):
        worst = max(worst, relative(abs(loss - b["losses"][step]), loss))
        for kind in ("grads", "params"):
            for name, value in a[kind][step].items():
                worst = max(worst, tensor_rel(value, b[kind][step][name]))
    return worst
