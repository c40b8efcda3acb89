"""Calibration of the device and the network on the two ranks: point-to-point and all-reduce lines, the layer's
compute rate by micro-batch size, memory traffic, the activation factor, AdamW's costs and the ranks' contention.

Called from `bench.calibrate` on its two ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.bench.calibrate_timing import (
    LayerShape, line_fit, median_time, once, paired_ratio, reference_model, relative_fit,
)
from pipetrain.launch.memory import current_memory_mb, peak_memory_mb, reset_peak_memory
from pipetrain.pipeline.clock import clock_for
from pipetrain.plan.model import config_blocks

__all__ = ["SIZES", "network_figures", "activation_factor", "optimizer_figures", "compute_figures"]

SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 20]  # float32 elements: 4 KB .. 4 MB


def network_figures(rank: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Point-to-point (ping-pong) and all-reduce latency and bandwidth over `SIZES`, from least-squares lines."""
    p2p, reduce, clock = [], [], clock_for(device)
    for n in SIZES:
        t = torch.ones(n, device=device)

        def ping() -> None:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

        p2p.append(median_time(ping, repeats, clock) / 2)
        reduce.append(median_time(lambda: dist.all_reduce(t), repeats, clock))
    nbytes = [4.0 * n for n in SIZES]
    p2p_lat, p2p_slope = line_fit(nbytes, p2p)
    ar_lat, ar_slope = line_fit([b * 2 * (2 - 1) / 2 for b in nbytes], reduce)  # ring volume for n = 2
    return {"p2p_latency_s": p2p_lat, "p2p_bytes_per_s": 1 / p2p_slope,
            "collective_latency_s": ar_lat / 2, "collective_bytes_per_s": 1 / ar_slope}


def activation_factor(shape: LayerShape, samples: int, device: torch.device) -> float:
    """Peak memory growth per sample of one layer's forward+backward over the bytes the model says it keeps
    (allocator caching, backward transients; CPU: resident memory), at `samples` after a 1-sample warm-up
    (which takes the one-time allocations of the first backward)."""
    model = reference_model(shape)
    layer = model.layer().to(device)
    growth = 0.0
    for b in (1, samples):
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        reset_peak_memory(device)
        before = current_memory_mb(device)
        layer(x).sum().backward()
        growth = (peak_memory_mb(device) - before) * 2**20
    return max(growth / (samples * config_blocks(model.config)[1].activation_bytes), 0.5)


def optimizer_figures(device: torch.device, repeats: int) -> tuple[float, float]:
    """AdamW's seconds per parameter (one 1M-element tensor) and per tensor (256 tensors of 16 elements)."""
    def adamw(tensors: int, numel: int) -> float:
        params = [nn.Parameter(torch.zeros(numel, device=device)) for _ in range(tensors)]
        for param in params:
            param.grad = torch.ones_like(param)
        return median_time(torch.optim.AdamW(params).step, repeats, clock_for(device))

    per_param = adamw(1, 1 << 20) / (1 << 20)
    per_tensor = max(adamw(256, 16) / 256 - 16 * per_param, 0.0)
    return per_param, per_tensor


def compute_figures(shape: LayerShape, samples: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """The device's figures: activation factor, FLOP rate by samples, memory traffic rate, kernel overhead,
    AdamW's costs and the slowdown of ranks sharing the machine (`contention`)."""
    factor = activation_factor(shape, 64, device)  # first, while the allocator holds nothing
    clock = clock_for(device)
    big = torch.ones(1 << 22, device=device)
    add = median_time(lambda: big.add_(1.0), repeats, clock)
    bytes_per_s = 2 * 4 * big.numel() / add
    model = reference_model(shape)
    layer = model.layer().to(device)

    def step(b: int) -> Callable[[], None]:
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        return lambda: layer(x).sum().backward()

    sizes = [1 << k for k in range(samples.bit_length()) if 1 << k <= samples]
    alone: list[float] = []
    for turn in range(dist.get_world_size()):  # each rank in turn while the others wait
        dist.barrier()
        if dist.get_rank() == turn:
            alone = [median_time(step(b), repeats, clock) for b in sizes]
        dist.barrier()
    middle = step(min(64, sizes[-1]))
    turns = itertools.count()

    def alone_once() -> float | None:  # the ranks take turns; the others wait at the barrier
        dist.barrier()
        mine = next(turns) % dist.get_world_size() == dist.get_rank()
        seconds = once(middle, clock) if mine else None
        dist.barrier()
        return seconds

    slower = paired_ratio(lambda: once(middle, clock), alone_once, 2 * repeats)  # together first: alone's turn is its pair's
    block = config_blocks(model.config)[1]
    fixed, _ = relative_fit(sizes[:3], alone[:3])  # the launch overhead, for blocks without a measured rate
    rates = [(b, 3 * b * block.forward_flops / t) for b, t in zip(sizes, alone)]  # everything included
    per_param, per_tensor = optimizer_figures(device, repeats)
    return {"activation_factor": factor, "flops_per_s": rates[-1][1], "rate_by_samples": rates,
            "bytes_per_s": bytes_per_s, "kernel_overhead_s": fixed / (3 * block.kernels),
            "optimizer_s_per_param": per_param, "optimizer_s_per_tensor": per_tensor,
            "contention": max((slower or 1.0) - 1.0, 0.0)}
