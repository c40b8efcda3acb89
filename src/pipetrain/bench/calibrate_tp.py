"""Calibration of tensor parallelism's per-collective cost: one DTensor all-reduce as a TP layer runs it.

A split layer's all-reduce is not the bare ring `dist.all_reduce` the network calibration times back to back: it
goes through DTensor (`from_local(Partial)` -> `redistribute(Replicate)`: placement logic, the functional
collective, its wait) between the rank's own work, and it waits for the slower peer. Two ranks measure, in
alternation, a bare all-reduce and the DTensor one of the same small tensor, each after the same short
matmul (the work between a layer's collectives, so that the ranks drift as they do in training); the
figure is the DTensor call's *mean* time (a step pays every call, the slow ones included) minus the bare
call's median: `tp_collective_s`, the fixed cost the planner adds to each TP collective beyond the ring's
latency and bandwidth (plan/tensor.py). Called from `bench.calibrate` on its two ranks.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from pipetrain.pipeline.clock import clock_for

__all__ = ["tp_collective_figures"]

_NUMEL = 1 << 12  # 16 KB: one sample of the cpu preset's (s, h) activation, where the fixed cost dominates
_WORK = 96  # the square matmul between two collectives


def tp_collective_figures(device: torch.device, repeats: int) -> dict[str, float]:
    """{"tp_collective_s": seconds} measured on this rank (the caller takes the ranks' median)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    x = torch.ones(_NUMEL, device=device)
    a = torch.randn(_WORK, _WORK, device=device)
    clock = clock_for(device)

    def bare() -> None:
        dist.all_reduce(x)

    def dtensor() -> None:
        DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    bare_times, dtensor_times = [], []
    dist.barrier()
    for index in range(8 * repeats + 2):
        for fn, times in ((bare, bare_times), (dtensor, dtensor_times)):
            a @ a
            seconds = clock.seconds(fn)
            if index >= 2:  # warm-up
                times.append(seconds)
    return {"tp_collective_s": max(statistics.fmean(dtensor_times) - statistics.median(bare_times), 0.0)}
