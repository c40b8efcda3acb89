"""Calibration: measure this machine's device and network with the real backend (gloo on CPU, NCCL on GPUs).

Two ranks are spawned (on the same node) and measure, each figure a median of repeats:

- point-to-point: ping-pong of 4 KB .. 4 MB tensors, latency and bandwidth from a least-squares line;
- all-reduce: the same sizes, latency and ring bus bandwidth (2 (n-1)/n bytes per element moved);
- compute: forward+backward of one `nn.TransformerEncoderLayer` of the planned model's shape and dropout,
  each rank alone at 1, 2, 4 .. `samples` samples: each size gives the layer's effective FLOP rate, its
  launch overheads and memory traffic included (`rate_by_samples`: small matrices run slower and, on CPUs,
  large ones fall out of cache); the intercept of the smallest three (least squares in relative error)
  gives the per-kernel overhead that the other blocks (embedding, head) pay, and a large tensor add their
  memory traffic rate; then every rank at once at 64 samples: the
  slowdown when the ranks share the machine (`contention`; on CPU the planner also knows the cores, so it
  can share them among more ranks);
  AdamW's time per parameter (one large tensor) and per parameter tensor (many small ones); how much longer
  4 such layers take as a 2-stage pipeline of one micro-batch than in one process (`pipeline_slowdown`: the
  same work handed between ranks, measured in alternation, about 5-10 % on this CPU); the host-side cost of one schedule action (a 2-stage
  pipeline of tiny layers, 1 against 16 micro-batches); the rank's memory before any model (CPU: RSS);
  the activation factor: a layer's peak memory growth per sample over the bytes the analytic model says it
  keeps for backward (CPU: resident memory, whose peak also holds backward transients and freed blocks).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.bench.memory import current_memory_mb, peak_memory_mb, reset_peak_memory
from pipetrain.blocks import ModuleListModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.plan.hardware import Calibration, Device, Network
from pipetrain.plan.model import transformer_blocks
from pipetrain.session import build_session, close_session, join_job

__all__ = ["calibrate", "LayerShape"]

LayerShape = dict  # seq_len, emsize, nhead, nhid, dropout (the planned model's encoder layer)
_SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 20]  # float32 elements: 4 KB .. 4 MB


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope. When noise makes the slope <= 0, the slope is that of the largest
    point through the origin (a conservative bandwidth); the intercept is clamped at 1 ns."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        slope = ys[-1] / xs[-1]
    return max(my - slope * mx, 1e-9), slope


def _network(rank: int, device: torch.device, repeats: int) -> dict[str, float]:
    p2p, reduce = [], []
    for n in _SIZES:
        t = torch.ones(n, device=device)

        def ping() -> None:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

        p2p.append(_median_time(ping, repeats) / 2)
        reduce.append(_median_time(lambda: dist.all_reduce(t), repeats))
    nbytes = [4.0 * n for n in _SIZES]
    p2p_lat, p2p_slope = _line(nbytes, p2p)
    ar_lat, ar_slope = _line([b * 2 * (2 - 1) / 2 for b in nbytes], reduce)  # ring volume for n = 2
    return {"p2p_latency_s": p2p_lat, "p2p_bytes_per_s": 1 / p2p_slope,
            "collective_latency_s": ar_lat / 2, "collective_bytes_per_s": 1 / ar_slope}


def _activation_factor(shape: LayerShape, samples: int, device: torch.device) -> float:
    """Peak memory growth per sample of one layer's forward+backward over the bytes the model says it keeps
    (allocator caching, backward transients; CPU: resident memory), at `samples` after a 1-sample warm-up
    (which takes the one-time allocations of the first backward)."""
    dropout = shape.get("dropout", 0.1)
    layer = nn.TransformerEncoderLayer(shape["emsize"], shape["nhead"], shape["nhid"], dropout, batch_first=True,
                                       norm_first=True).to(device)
    growth = 0.0
    for b in (1, samples):
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        reset_peak_memory(device)
        before = current_memory_mb(device)
        layer(x).sum().backward()
        growth = (peak_memory_mb(device) - before) * 2**20
    blocks = transformer_blocks(vocab_size=2, num_classes=2, nlayers=1, **{"dropout": 0.1, **shape})
    return max(growth / (samples * blocks[1].activation_bytes), 0.5)


def _fit(sizes: list[int], times: list[float]) -> tuple[float, float]:
    """Intercept and slope of `times` over `sizes`, least squares in relative error (each point weighs
    1/time², so that small micro-batches count as much as large ones); the slope is kept positive."""
    weights = [1.0 / t**2 for t in times]
    sw = sum(weights)
    mx = sum(w * x for w, x in zip(weights, sizes)) / sw
    my = sum(w * y for w, y in zip(weights, times)) / sw
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, sizes, times))
    slope /= sum(w * (x - mx) ** 2 for w, x in zip(weights, sizes))
    slope = max(slope, 0.25 * times[-1] / sizes[-1])
    return max(my - slope * mx, 0.0), slope


def _optimizer(device: torch.device, repeats: int) -> tuple[float, float]:
    """AdamW's seconds per parameter (one 1M-element tensor) and per tensor (256 tensors of 16 elements)."""
    def adamw(tensors: int, numel: int) -> float:
        params = [nn.Parameter(torch.zeros(numel, device=device)) for _ in range(tensors)]
        for param in params:
            param.grad = torch.ones_like(param)
        return _median_time(torch.optim.AdamW(params).step, repeats)

    per_param = adamw(1, 1 << 20) / (1 << 20)
    per_tensor = max(adamw(256, 16) / 256 - 16 * per_param, 0.0)
    return per_param, per_tensor


def _compute(shape: LayerShape, samples: int, device: torch.device, repeats: int) -> dict[str, Any]:
    factor = _activation_factor(shape, 64, device)  # first, while the allocator holds nothing
    big = torch.ones(1 << 22, device=device)
    add = _median_time(lambda: big.add_(1.0), repeats)
    bytes_per_s = 2 * 4 * big.numel() / add
    dropout = shape.get("dropout", 0.1)
    layer = nn.TransformerEncoderLayer(shape["emsize"], shape["nhead"], shape["nhid"], dropout, batch_first=True,
                                       norm_first=True).to(device)

    def step(b: int) -> Callable[[], None]:
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        return lambda: layer(x).sum().backward()

    sizes = [1 << k for k in range(samples.bit_length()) if 1 << k <= samples]
    alone: list[float] = []
    for turn in range(dist.get_world_size()):  # each rank in turn while the others wait
        dist.barrier()
        if dist.get_rank() == turn:
            alone = [_median_time(step(b), repeats) for b in sizes]
        dist.barrier()
    middle = min(64, sizes[-1])
    together = _median_time(step(middle), repeats)  # every rank at once
    block = transformer_blocks(vocab_size=2, num_classes=2, nlayers=1, **{"dropout": 0.1, **shape})[1]
    fixed, _ = _fit(sizes[:3], alone[:3])  # the launch overhead, for blocks without a measured rate
    rates = [(b, 3 * b * block.forward_flops / t) for b, t in zip(sizes, alone)]  # everything included
    per_param, per_tensor = _optimizer(device, repeats)
    return {"activation_factor": factor, "flops_per_s": rates[-1][1], "rate_by_samples": rates,
            "bytes_per_s": bytes_per_s, "kernel_overhead_s": fixed / (3 * block.kernels),
            "optimizer_s_per_param": per_param, "optimizer_s_per_tensor": per_tensor,
            "contention": max(together / alone[sizes.index(middle)] - 1.0, 0.0)}


def _action_overhead(device: torch.device, repeats: int) -> float:
    """Seconds per schedule action beyond compute: a 2-stage GPipe of tiny layers, 16 vs 1 micro-batches."""
    model = ModuleListModel([nn.Linear(8, 8), nn.Linear(8, 2)], example_input=torch.zeros(1, 8))
    times = []
    for chunks in (1, 16):
        config = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="gpipe", n_microbatches=chunks))
        engine = build_session(model, config, device).engine
        x, y = torch.zeros(16, 8, device=device), torch.zeros(16, dtype=torch.long, device=device)
        times.append(_median_time(lambda: engine.step(x, y), repeats))
    return max(times[1] - times[0], 0.0) / (2 * 15)


class _MeanHead(nn.Module):
    """Hidden states [batch, seq, emsize] -> 2 logits: the mean over the sequence, then a linear layer."""

    def __init__(self, emsize: int) -> None:
        super().__init__()
        self.linear = nn.Linear(emsize, 2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.mean(dim=1))


def _pipeline_slowdown(shape: LayerShape, device: torch.device, samples: int, repeats: int) -> float:
    """How much longer 4 layers of the planned shape take as a 2-stage pipeline of one micro-batch (no
    overlap: the same work, handed from rank to rank) than in one process: the median ratio of 5 rounds."""
    blocks = [nn.TransformerEncoderLayer(shape["emsize"], shape["nhead"], shape["nhid"], shape.get("dropout", 0.1),
                                         batch_first=True, norm_first=True) for _ in range(4)]
    blocks.append(_MeanHead(shape["emsize"]))
    x = torch.randn(samples, shape["seq_len"], shape["emsize"], device=device)
    y = torch.zeros(samples, dtype=torch.long, device=device)
    config = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="gpipe", n_microbatches=1))
    engine = build_session(ModuleListModel(blocks, example_input=x[:1]), config, device).engine
    plain = nn.Sequential(*blocks).to(device)
    piped, single = [], []
    for _ in range(5):  # rounds side by side: this machine's speed drifts within seconds
        piped.append(_median_time(lambda: engine.step(x, y), repeats))
        dist.barrier()
        if dist.get_rank() == 0:  # the same layers in one process, while rank 1 waits
            single.append(_median_time(lambda: nn.functional.cross_entropy(plain(x), y).backward(), repeats))
        dist.barrier()
    ratio = [statistics.median(p / s for p, s in zip(piped, single)) - 1.0 if single else 0.0]
    dist.broadcast_object_list(ratio, src=0)
    return max(ratio[0], 0.0)


def _rank(spec: RankSpec, shape: LayerShape, samples: int, repeats: int, out: str) -> None:
    device = join_job(spec)
    try:
        baseline = current_memory_mb(device) * 2**20
        figures = {**_network(spec.rank, device, repeats), **_compute(shape, samples, device, repeats),
                   "action_overhead_s": _action_overhead(device, repeats), "baseline_bytes": baseline,
                   "pipeline_slowdown": _pipeline_slowdown(shape, device, 64, repeats)}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, figures)
        if spec.rank == 0:
            keys = figures.keys()
            merged = {k: statistics.median(g[k] for g in gathered) for k in keys if k != "rate_by_samples"}
            merged["rate_by_samples"] = [(b, statistics.median(g["rate_by_samples"][i][1] for g in gathered))
                                         for i, (b, _) in enumerate(figures["rate_by_samples"])]
            merged["backend"] = dist.get_backend()
            merged["device"] = str(device)
            Path(out, "calibration.json").write_text(json.dumps(merged))
    finally:
        close_session()


def calibrate(shape: LayerShape, *, samples: int = 256, repeats: int = 9, timeout_s: float = 600.0) -> Calibration:
    """Measure with two spawned ranks and return the calibration (its `measured` field says when and on what).
    `samples` (>= 4): the largest micro-batch the layer is timed at."""
    if samples < 4:
        raise ValueError(f"calibrate needs samples >= 4, got {samples}")
    with tempfile.TemporaryDirectory(prefix="pipetrain-calibrate-") as work:
        spawn(_rank, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
              args=(shape, samples, repeats, work), timeout_s=timeout_s)
        m = json.loads(Path(work, "calibration.json").read_text())
    memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else _host_memory()
    device = Device(name=m["device"], flops_per_s=m["flops_per_s"], bytes_per_s=m["bytes_per_s"],
                    kernel_overhead_s=m["kernel_overhead_s"], action_overhead_s=m["action_overhead_s"],
                    optimizer_s_per_param=m["optimizer_s_per_param"],
                    optimizer_s_per_tensor=m["optimizer_s_per_tensor"], memory_bytes=float(memory),
                    activation_factor=m["activation_factor"], contention=m["contention"],
                    pipeline_slowdown=m["pipeline_slowdown"],
                    rate_by_samples=tuple((float(b), r) for b, r in m["rate_by_samples"]),
                    cores=0 if torch.cuda.is_available() else len(os.sched_getaffinity(0)),
                    baseline_bytes=m["baseline_bytes"] if m["device"] == "cpu" else 0.0)
    network = Network(p2p_latency_s=m["p2p_latency_s"], p2p_bytes_per_s=m["p2p_bytes_per_s"],
                      inter_latency_s=m["p2p_latency_s"], inter_bytes_per_s=m["p2p_bytes_per_s"],
                      collective_latency_s=m["collective_latency_s"], collective_bytes_per_s=m["collective_bytes_per_s"])
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Calibration(device=device, network=network, backend=m["backend"],
                       measured=f"{stamp}, 2 ranks on one node, layer {shape}")


def _host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
