"""Calibration of tensor parallelism's fixed costs: one encoder layer split by the classifier's TP plan, timed.

The planner prices a split layer as its share of the compute plus the ring all-reduces of Megatron's count
(plan/tensor.py). What that leaves out is fixed per call: DTensor's host work around every split operation
and collective (placement logic, the functional collective and its wait), and the wait for the slower peer
at each of the layer's synchronising all-reduces. So the two calibration ranks split one layer of the
planned shape over a mesh named "tp" (`tensor_parallel_blocks`, the engine's own path) and time, in
alternation with the unsplit layer, its forward+backward on a small micro-batch and an AdamW step over its
parameters, taking *means* (a step pays every call, the slow ones included). The figures:

- `tp_collective_s`: (measured split forward+backward - what the planner predicts for it without this term)
  / (its collectives, forward and backward): the fixed cost the planner then adds to each TP collective;
- `optimizer_s_per_dtensor`: (AdamW over the split layer - over the unsplit one) / its DTensor parameters:
  an optimizer step over DTensors runs every elementwise operation through DTensor's dispatch (and the
  strided QKV weights' redistributions).

Called from `bench.calibrate` on its two ranks, after the compute and network figures it uses.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.parallel.tensor import tensor_parallel_blocks
from pipetrain.pipeline.clock import clock_for
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import config_blocks
from pipetrain.plan.predict import block_times
from pipetrain.plan.tensor import allreduce_s
from pipetrain.workloads.presets import TransformerConfig
from pipetrain.workloads.transformer import TransformerClassifier

__all__ = ["tp_figures", "TP_SAMPLES"]

#: The micro-batch the split layer is timed at (the bench's tp cells run 8 to 32 samples per micro-batch).
TP_SAMPLES = 8


def tp_figures(shape: dict, device: torch.device, figures: dict[str, Any], repeats: int) -> dict[str, float]:
    """{"tp_collective_s", "optimizer_s_per_dtensor"} measured on this rank (the caller takes the ranks'
    median); `figures`: the calibration's compute and network figures measured so far."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    tp = dist.get_world_size()
    mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
    model = TransformerClassifier(TransformerConfig(vocab_size=2, nlayers=1, **{"dropout": 0.1, **shape}))
    plain = model.layer().to(device)
    split = tensor_parallel_blocks(model, mesh)(1, model.layer().to(device))
    x = torch.randn(TP_SAMPLES, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
    clock = clock_for(device)
    opt_split = torch.optim.AdamW(split.parameters(), lr=1e-6)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    times: dict[str, list[float]] = {"split": [], "plain": [], "opt_split": [], "opt_plain": []}
    dist.barrier()
    for index in range(4 * repeats + 2):
        for name, fn in (("split", lambda: split(x).sum().backward()), ("plain", lambda: plain(x).sum().backward()),
                         ("opt_split", opt_split.step), ("opt_plain", opt_plain.step)):
            seconds = clock.seconds(fn)
            if index >= 2:  # warm-up
                times[name].append(seconds)
    block = config_blocks(model.config)[1]
    rates = tuple((float(b), r) for b, r in figures["rate_by_samples"])
    rated = Device(name="calibrating", flops_per_s=rates[-1][1], bytes_per_s=figures["bytes_per_s"],
                   kernel_overhead_s=figures["kernel_overhead_s"], action_overhead_s=0.0, optimizer_s_per_param=0.0,
                   memory_bytes=0.0, rate_by_samples=rates)
    network = Network(p2p_latency_s=0.0, p2p_bytes_per_s=1.0, inter_latency_s=0.0, inter_bytes_per_s=1.0,
                      collective_latency_s=figures["collective_latency_s"],
                      collective_bytes_per_s=figures["collective_bytes_per_s"])
    compute = sum(block_times(block, TP_SAMPLES, rated, tp)) * (1.0 + figures.get("contention", 0.0))
    calls = 2 * block.tensor.collectives  # forward and backward
    ring = calls * allreduce_s(TP_SAMPLES * block.tensor.comm_bytes, tp, network)
    fixed = (statistics.fmean(times["split"]) - compute - ring) / (calls * (tp - 1))
    dtensors = sum(isinstance(p, DTensor) for p in split.parameters())
    extra = (statistics.fmean(times["opt_split"]) - statistics.fmean(times["opt_plain"])) / max(dtensors, 1)
    return {"tp_collective_s": max(fixed, 0.0), "optimizer_s_per_dtensor": max(extra, 0.0)}
