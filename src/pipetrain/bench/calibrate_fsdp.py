"""Calibration of FSDP2's fixed cost per parameter group: one encoder layer `fully_shard`ed over two ranks, timed.

The planner prices data parallelism's gradient traffic on the ring (plan/times.py `reduce_s`): FSDP's
reduce-scatter and all-gathers move 3 (n-1)/n of the parameter bytes. What that leaves out is fixed per
call: FSDP2 copies each group's parameters into one flat buffer before its all-gather and out of it after
(and the gradients around the reduce-scatter), runs its hooks and waits for the slower peer — at small
groups on gloo that is most of the cost. So the two calibration ranks shard one layer of the planned shape
over a mesh named "dp" as the engine does (`fully_shard`, `reshard_after_forward=False`) and time, in
alternation with the unsharded layer, its forward+backward on a small micro-batch (one all-gather in
forward, one reduce-scatter in backward, resharded after it) and take the median difference:

- `fsdp_group_s`: (sharded - unsharded - the ring's time for the layer's bytes) per parameter group and
  step, which the planner adds per FSDP group (each block and the stage's root) to the stage's reduction.

Called from `bench.calibrate` on its two ranks, after the network figures it uses.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.pipeline.clock import clock_for
from pipetrain.workloads.classifier.presets import TransformerConfig
from pipetrain.workloads.classifier.model import TransformerClassifier

__all__ = ["fsdp_figures"]

_SAMPLES = 8


def fsdp_figures(shape: dict, device: torch.device, figures: dict[str, Any], repeats: int) -> dict[str, float]:
    """{"fsdp_group_s": seconds} measured on this rank (the caller takes the ranks' median)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n = dist.get_world_size()
    mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("dp",))
    model = TransformerClassifier(TransformerConfig(vocab_size=2, nlayers=1, **{"dropout": 0.1, **shape}))
    plain = model.layer().to(device)
    sharded = fully_shard(model.layer().to(device), mesh=mesh, reshard_after_forward=False)
    param_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    x = torch.randn(_SAMPLES, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
    clock = clock_for(device)
    times: dict[str, list[float]] = {"sharded": [], "plain": []}
    dist.barrier()
    for index in range(4 * repeats + 2):
        for name, layer in (("sharded", sharded), ("plain", plain)):
            seconds = clock.seconds(lambda: layer(x).sum().backward())
            if index >= 2:  # warm-up
                times[name].append(seconds)
    ring = (3 * (n - 1) / n * param_bytes / figures["collective_bytes_per_s"]
            + 2 * (n - 1) * figures["collective_latency_s"])
    fixed = statistics.median(s - p for s, p in zip(times["sharded"], times["plain"])) - ring
    return {"fsdp_group_s": max(fixed, 0.0)}
