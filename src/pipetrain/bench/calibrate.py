"""Calibration: measure this machine's device and network with the real backend (gloo on CPU, NCCL on GPUs).

Two ranks are spawned (on the same node) and measure, each figure a median of repeats:

- point-to-point: ping-pong of 4 KB .. 4 MB tensors, latency and bandwidth from a least-squares line;
- all-reduce: the same sizes, latency and ring bus bandwidth (2 (n-1)/n bytes per element moved);
- compute, on both ranks at once (as pipeline ranks share the machine): forward+backward of one
  `nn.TransformerEncoderLayer` of the planned model's shape at 1 and at `samples` samples: the slope gives
  the effective FLOP rate (after the memory traffic, measured by a large tensor add), the intercept the
  per-kernel overhead; AdamW's time per parameter; the host-side cost of one schedule action (a 2-stage
  pipeline of tiny layers, 1 against 16 micro-batches); the rank's memory before any model (CPU: RSS);
  the activation factor: a layer's peak memory growth per sample over the bytes the analytic model says it
  keeps for backward (CPU: resident memory, whose peak also holds backward transients and freed blocks).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
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

LayerShape = dict  # seq_len, emsize, nhead, nhid (the planned model's encoder layer)
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
    (allocator caching, backward transients; CPU: resident memory), at 4 x `samples` after a 1-sample warm-up
    (which takes the one-time allocations of the first backward)."""
    layer = nn.TransformerEncoderLayer(shape["emsize"], shape["nhead"], shape["nhid"], 0.1, batch_first=True,
                                       norm_first=True).to(device)
    growth = 0.0
    for b in (1, 4 * samples):
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        reset_peak_memory(device)
        before = current_memory_mb(device)
        layer(x).sum().backward()
        growth = (peak_memory_mb(device) - before) * 2**20
    blocks = transformer_blocks(vocab_size=2, num_classes=2, nlayers=1, dropout=0.1, **shape)
    return max(growth / (4 * samples * blocks[1].activation_bytes), 0.5)


def _compute(shape: LayerShape, samples: int, device: torch.device, repeats: int) -> dict[str, float]:
    factor = _activation_factor(shape, samples, device)  # first, while the allocator holds nothing
    big = torch.ones(1 << 22, device=device)
    add = _median_time(lambda: big.add_(1.0), repeats)
    bytes_per_s = 2 * 4 * big.numel() / add
    layer = nn.TransformerEncoderLayer(shape["emsize"], shape["nhead"], shape["nhid"], 0.0, batch_first=True,
                                       norm_first=True).to(device)

    def step(b: int) -> Callable[[], None]:
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        return lambda: layer(x).sum().backward()

    one, many = _median_time(step(1), repeats), _median_time(step(samples), repeats)
    blocks = transformer_blocks(vocab_size=2, num_classes=2, nlayers=1, dropout=0.0, **shape)
    block = blocks[1]
    per_sample = max((many - one) / (samples - 1), 0.25 * many / samples)  # noise can make the slope <= 0
    traffic_s = 3 * block.forward_traffic / bytes_per_s
    flops_per_s = 3 * block.forward_flops / max(per_sample - traffic_s, per_sample * 0.1)
    kernel_overhead = max(one - per_sample, 0.0) / (3 * block.kernels)
    params = nn.Parameter(torch.zeros(1 << 20, device=device))
    params.grad = torch.ones_like(params)
    adamw = torch.optim.AdamW([params])
    optimizer = _median_time(adamw.step, repeats) / params.numel()
    return {"activation_factor": factor, "flops_per_s": flops_per_s, "bytes_per_s": bytes_per_s, "kernel_overhead_s": kernel_overhead,
            "optimizer_s_per_param": optimizer}


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


def _rank(spec: RankSpec, shape: LayerShape, samples: int, repeats: int, out: str) -> None:
    device = join_job(spec)
    try:
        baseline = current_memory_mb(device) * 2**20
        figures = {**_network(spec.rank, device, repeats), **_compute(shape, samples, device, repeats),
                   "action_overhead_s": _action_overhead(device, repeats), "baseline_bytes": baseline}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, figures)
        if spec.rank == 0:
            keys = figures.keys()
            merged = {k: statistics.median(g[k] for g in gathered) for k in keys}
            merged["backend"] = dist.get_backend()
            merged["device"] = str(device)
            Path(out, "calibration.json").write_text(json.dumps(merged))
    finally:
        close_session()


def calibrate(shape: LayerShape, *, samples: int = 16, repeats: int = 7, timeout_s: float = 600.0) -> Calibration:
    """Measure with two spawned ranks and return the calibration (its `measured` field says when and on what)."""
    with tempfile.TemporaryDirectory(prefix="pipetrain-calibrate-") as work:
        spawn(_rank, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
              args=(shape, samples, repeats, work), timeout_s=timeout_s)
        m = json.loads(Path(work, "calibration.json").read_text())
    memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else _host_memory()
    device = Device(name=m["device"], flops_per_s=m["flops_per_s"], bytes_per_s=m["bytes_per_s"],
                    kernel_overhead_s=m["kernel_overhead_s"], action_overhead_s=m["action_overhead_s"],
                    optimizer_s_per_param=m["optimizer_s_per_param"], memory_bytes=float(memory),
                    activation_factor=m["activation_factor"],
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
