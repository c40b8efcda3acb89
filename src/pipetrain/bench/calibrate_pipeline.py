"""Calibration of the pipeline's own costs on the two ranks: a 2-stage GPipe of the planned layers against one
process and against the simulator (the slowdown of work handed between ranks, the host cost of a schedule action
and the engine's fixed cost per step).

Called from `bench.calibrate` on its two ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.bench.calibrate_timing import LayerShape, median_time, once, paired_ratio, reference_model
from pipetrain.blocks import ModuleListModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.pipeline.clock import clock_for
from pipetrain.plan.hardware import Device
from pipetrain.plan.model import config_blocks
from pipetrain.plan.overheads import StepSample, fit_overheads
from pipetrain.plan.schedules import schedule_order
from pipetrain.plan.simulate import StageCost, simulate
from pipetrain.plan.times import block_times
from pipetrain.session import build_session

__all__ = ["pipeline_figures"]


def pipeline_figures(shape: LayerShape, device: torch.device, rates: list[tuple[int, float]],
              repeats: int, precision: str = "fp32") -> dict[str, float]:
    """A 2-stage GPipe of 4 layers of the planned shape (2 per stage) at 64 samples, against the simulator.

    With 1 micro-batch, alternately with the same layers in one process: how much longer the same work takes
    handed from rank to rank (`pipeline_slowdown`). 16 micro-batches of 4, alternately with 1 of 64: how
    much longer they take than the simulated compute (the layer at the measured rates) says, per extra
    schedule action on the critical path, is the host cost of an action (`action_overhead_s`: torch's
    schedule, the transfers, caches refilled as micro-batches interleave); with the 1-micro-batch step's own
    seconds, what remains once per step is `step_overhead_s` (plan/overheads.py fits the two)."""
    reference = reference_model(shape)
    blocks = [*(reference.layer() for _ in range(4)), reference.head()]
    model = ModuleListModel(blocks, example_input=torch.zeros(1, shape["seq_len"], shape["emsize"]))
    x = torch.randn(64, shape["seq_len"], shape["emsize"], device=device)
    y = torch.zeros(64, dtype=torch.long, device=device)

    def engine(chunks: int):
        config = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="gpipe", n_microbatches=chunks))
        return build_session(model, config, device, precision=precision).engine

    whole, plain, clock = engine(1), nn.Sequential(*blocks).to(device), clock_for(device)

    def single_once() -> float | None:  # the same layers in one process, while rank 1 waits
        dist.barrier()
        seconds = (once(lambda: nn.functional.cross_entropy(plain(x), y).backward(), clock)
                   if dist.get_rank() == 0 else None)
        dist.barrier()
        return seconds

    ratio = [(paired_ratio(lambda: once(lambda: whole.step(x, y), clock), single_once, 3 * repeats) or 1.0) - 1.0]
    dist.broadcast_object_list(ratio, src=0)
    slowdown = max(ratio[0], 0.0)
    split = engine(16)
    longer = paired_ratio(lambda: once(lambda: split.step(x, y), clock),
                          lambda: once(lambda: whole.step(x, y), clock), 2 * repeats)
    rated = Device(name="calibrating", flops_per_s=rates[-1][1], bytes_per_s=1.0, kernel_overhead_s=0.0,
                   action_overhead_s=0.0, optimizer_s_per_param=0.0, memory_bytes=0.0, rate_by_samples=tuple(rates))
    layer = config_blocks(reference.config)[1]

    def span(chunks: int, overhead_s: float) -> float:
        forward, backward = block_times(layer, 64 // chunks, rated)
        stage = StageCost(forward_s=2 * forward * (1 + slowdown), backward_s=2 * backward * (1 + slowdown))
        return simulate(schedule_order("gpipe", 2, chunks), [stage, stage], overhead_s=overhead_s).span_s

    one = median_time(lambda: whole.step(x, y), repeats, clock)  # 1 micro-batch: the paired ratio's base
    few, many = (StepSample(measured, span(c, 0.0), span(c, 1.0) - span(c, 0.0))  # actions on the critical path
                 for c, measured in ((1, one), (16, (longer or 1.0) * one)))
    per_action, per_step = fit_overheads(few, many)
    return {"pipeline_slowdown": slowdown, "action_overhead_s": per_action, "step_overhead_s": per_step}
