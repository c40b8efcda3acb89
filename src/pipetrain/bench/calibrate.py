"""Calibration: measure this machine's device and network with the real backend (gloo on CPU, NCCL on GPUs).

Two ranks are spawned (on the same node) and measure:

- point-to-point: ping-pong of 4 KB .. 4 MB tensors, latency and bandwidth from a least-squares line;
- all-reduce: the same sizes, latency and ring bus bandwidth (2 (n-1)/n bytes per element moved);
- compute: forward+backward of one `nn.TransformerEncoderLayer` of the planned model's shape and dropout,
  each rank alone at 1, 2, 4 .. `samples` samples: each size gives the layer's effective FLOP rate, its
  launch overheads and memory traffic included (`rate_by_samples`: small matrices run slower and, on CPUs,
  large ones fall out of cache); the intercept of the smallest three (least squares in relative error)
  gives the per-kernel overhead that the other blocks (embedding, head) pay, and a large tensor add their
  memory traffic rate; ranks alone and all at once, in alternation: the slowdown when they share the
  machine (`contention`; on CPU the planner also knows the cores, so it can share them among more ranks);
- a DTensor all-reduce beyond the bare one, and AdamW over one layer split by the TP plan beyond the
  unsplit layer, per DTensor (`calibrate_tp.py`); one layer sharded by FSDP2: its
  fixed cost per parameter group beyond the ring (`calibrate_fsdp.py`);
- AdamW's time per parameter (one large tensor) and per parameter tensor (many small ones);
- a 2-stage pipeline of 4 such layers against the simulator (`_pipeline`): the slowdown of work handed
  from rank to rank, the host cost of one schedule action and the engine's fixed cost per step (its 1- and
  16-micro-batch steps, `plan/overheads.py`);
- the rank's memory before any model (CPU: RSS), and the activation factor: a layer's peak memory growth
  per sample over the bytes the analytic model says it keeps for backward (CPU: resident memory, whose
  peak also holds backward transients and freed blocks).

Each timing is a median of repeats; ratios are medians of pairs measured in alternation.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.bench.calibrate_fsdp import fsdp_figures
from pipetrain.bench.calibrate_tp import tp_figures
from pipetrain.launch.memory import current_memory_mb, device_baseline_bytes, peak_memory_mb, reset_peak_memory
from pipetrain.blocks import ModuleListModel
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.device import check_local_ranks, resolve_device
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.pipeline.clock import Clock, clock_for
from pipetrain.pipeline.precision import set_fp32_matmuls
from pipetrain.plan.hardware import DEFAULT_NETWORK, Calibration, Device, Network
from pipetrain.plan.model import config_blocks
from pipetrain.plan.overheads import StepSample, fit_overheads
from pipetrain.plan.predict import block_times
from pipetrain.plan.schedules import schedule_order
from pipetrain.plan.simulate import StageCost, simulate
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.classifier.presets import TransformerConfig
from pipetrain.workloads.classifier.model import TransformerClassifier

__all__ = ["calibrate", "LayerShape", "measured_network", "NOT_MEASURED", "inter_node_description"]

LayerShape = dict  # seq_len, emsize, nhead, nhid, dropout (the planned model's encoder layer)
_SIZES = [1 << 10, 1 << 14, 1 << 17, 1 << 20]  # float32 elements: 4 KB .. 4 MB


def _once(fn: Callable[[], None], clock: Clock) -> float:
    """Seconds `fn` took on the device (`clock`: on CUDA, synchronised before and after, so that queued kernels
    and NCCL calls are timed to their end, not to their launch)."""
    return clock.seconds(fn)


def _median_time(fn: Callable[[], None], repeats: int, clock: Clock) -> float:
    fn()  # warm-up
    return statistics.median(_once(fn, clock) for _ in range(repeats))


def _reference(shape: LayerShape) -> TransformerClassifier:
    """The reference Transformer with the planned layer (`shape`, dropout 0.1 unless given): its `layer()`
    and `head()` are what is timed, `config_blocks(...)[1]` the layer's analytic cost."""
    return TransformerClassifier(TransformerConfig(vocab_size=2, nlayers=1, **{"dropout": 0.1, **shape}))


def _paired_ratio(first: Callable[[], float | None], second: Callable[[], float | None], pairs: int) -> float | None:
    """The median of first() / second() over `pairs` alternations after a warm-up pair (each returns seconds,
    or None on a rank that does not measure): measured a fraction of a second apart, the machine's drift
    (more than 10 % within minutes here) cancels out."""
    ratios = []
    for index in range(pairs + 1):
        a, b = first(), second()
        if index and a is not None and b is not None:
            ratios.append(a / b)
    return statistics.median(ratios) if ratios else None


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope. When noise makes the slope <= 0, the slope is that of the largest
    point through the origin (a conservative bandwidth); the intercept is clamped at 1 ns."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        slope = ys[-1] / xs[-1]
    return max(my - slope * mx, 1e-9), slope


def _network(rank: int, device: torch.device, repeats: int) -> dict[str, float]:
    p2p, reduce, clock = [], [], clock_for(device)
    for n in _SIZES:
        t = torch.ones(n, device=device)

        def ping() -> None:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)

        p2p.append(_median_time(ping, repeats, clock) / 2)
        reduce.append(_median_time(lambda: dist.all_reduce(t), repeats, clock))
    nbytes = [4.0 * n for n in _SIZES]
    p2p_lat, p2p_slope = _line(nbytes, p2p)
    ar_lat, ar_slope = _line([b * 2 * (2 - 1) / 2 for b in nbytes], reduce)  # ring volume for n = 2
    return {"p2p_latency_s": p2p_lat, "p2p_bytes_per_s": 1 / p2p_slope,
            "collective_latency_s": ar_lat / 2, "collective_bytes_per_s": 1 / ar_slope}


def _activation_factor(shape: LayerShape, samples: int, device: torch.device) -> float:
    """Peak memory growth per sample of one layer's forward+backward over the bytes the model says it keeps
    (allocator caching, backward transients; CPU: resident memory), at `samples` after a 1-sample warm-up
    (which takes the one-time allocations of the first backward)."""
    model = _reference(shape)
    layer = model.layer().to(device)
    growth = 0.0
    for b in (1, samples):
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        reset_peak_memory(device)
        before = current_memory_mb(device)
        layer(x).sum().backward()
        growth = (peak_memory_mb(device) - before) * 2**20
    return max(growth / (samples * config_blocks(model.config)[1].activation_bytes), 0.5)


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
        return _median_time(torch.optim.AdamW(params).step, repeats, clock_for(device))

    per_param = adamw(1, 1 << 20) / (1 << 20)
    per_tensor = max(adamw(256, 16) / 256 - 16 * per_param, 0.0)
    return per_param, per_tensor


def _compute(shape: LayerShape, samples: int, device: torch.device, repeats: int) -> dict[str, Any]:
    factor = _activation_factor(shape, 64, device)  # first, while the allocator holds nothing
    clock = clock_for(device)
    big = torch.ones(1 << 22, device=device)
    add = _median_time(lambda: big.add_(1.0), repeats, clock)
    bytes_per_s = 2 * 4 * big.numel() / add
    model = _reference(shape)
    layer = model.layer().to(device)

    def step(b: int) -> Callable[[], None]:
        x = torch.randn(b, shape["seq_len"], shape["emsize"], device=device, requires_grad=True)
        return lambda: layer(x).sum().backward()

    sizes = [1 << k for k in range(samples.bit_length()) if 1 << k <= samples]
    alone: list[float] = []
    for turn in range(dist.get_world_size()):  # each rank in turn while the others wait
        dist.barrier()
        if dist.get_rank() == turn:
            alone = [_median_time(step(b), repeats, clock) for b in sizes]
        dist.barrier()
    middle = step(min(64, sizes[-1]))
    turns = itertools.count()

    def alone_once() -> float | None:  # the ranks take turns; the others wait at the barrier
        dist.barrier()
        mine = next(turns) % dist.get_world_size() == dist.get_rank()
        seconds = _once(middle, clock) if mine else None
        dist.barrier()
        return seconds

    slower = _paired_ratio(lambda: _once(middle, clock), alone_once, 2 * repeats)  # together first: alone's turn is its pair's
    block = config_blocks(model.config)[1]
    fixed, _ = _fit(sizes[:3], alone[:3])  # the launch overhead, for blocks without a measured rate
    rates = [(b, 3 * b * block.forward_flops / t) for b, t in zip(sizes, alone)]  # everything included
    per_param, per_tensor = _optimizer(device, repeats)
    return {"activation_factor": factor, "flops_per_s": rates[-1][1], "rate_by_samples": rates,
            "bytes_per_s": bytes_per_s, "kernel_overhead_s": fixed / (3 * block.kernels),
            "optimizer_s_per_param": per_param, "optimizer_s_per_tensor": per_tensor,
            "contention": max((slower or 1.0) - 1.0, 0.0)}


def _pipeline(shape: LayerShape, device: torch.device, rates: list[tuple[int, float]],
              repeats: int, precision: str = "fp32") -> dict[str, float]:
    """A 2-stage GPipe of 4 layers of the planned shape (2 per stage) at 64 samples, against the simulator.

    With 1 micro-batch, alternately with the same layers in one process: how much longer the same work takes
    handed from rank to rank (`pipeline_slowdown`). 16 micro-batches of 4, alternately with 1 of 64: how
    much longer they take than the simulated compute (the layer at the measured rates) says, per extra
    schedule action on the critical path, is the host cost of an action (`action_overhead_s`: torch's
    schedule, the transfers, caches refilled as micro-batches interleave); with the 1-micro-batch step's own
    seconds, what remains once per step is `step_overhead_s` (plan/overheads.py fits the two)."""
    reference = _reference(shape)
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
        seconds = (_once(lambda: nn.functional.cross_entropy(plain(x), y).backward(), clock)
                   if dist.get_rank() == 0 else None)
        dist.barrier()
        return seconds

    ratio = [(_paired_ratio(lambda: _once(lambda: whole.step(x, y), clock), single_once, 3 * repeats) or 1.0) - 1.0]
    dist.broadcast_object_list(ratio, src=0)
    slowdown = max(ratio[0], 0.0)
    split = engine(16)
    longer = _paired_ratio(lambda: _once(lambda: split.step(x, y), clock),
                           lambda: _once(lambda: whole.step(x, y), clock), 2 * repeats)
    rated = Device(name="calibrating", flops_per_s=rates[-1][1], bytes_per_s=1.0, kernel_overhead_s=0.0,
                   action_overhead_s=0.0, optimizer_s_per_param=0.0, memory_bytes=0.0, rate_by_samples=tuple(rates))
    layer = config_blocks(reference.config)[1]

    def span(chunks: int, overhead_s: float) -> float:
        forward, backward = block_times(layer, 64 // chunks, rated)
        stage = StageCost(forward_s=2 * forward * (1 + slowdown), backward_s=2 * backward * (1 + slowdown))
        return simulate(schedule_order("gpipe", 2, chunks), [stage, stage], overhead_s=overhead_s).span_s

    one = _median_time(lambda: whole.step(x, y), repeats, clock)  # 1 micro-batch: the paired ratio's base
    few, many = (StepSample(measured, span(c, 0.0), span(c, 1.0) - span(c, 0.0))  # actions on the critical path
                 for c, measured in ((1, one), (16, (longer or 1.0) * one)))
    per_action, per_step = fit_overheads(few, many)
    return {"pipeline_slowdown": slowdown, "action_overhead_s": per_action, "step_overhead_s": per_step}


def _rank(spec: RankSpec, shape: LayerShape, samples: int, repeats: int, out: str, precision: str = "fp32") -> None:
    device = join_job(spec)
    set_fp32_matmuls(device, precision)  # the arithmetic training at `precision` uses (TF32 or IEEE on CUDA)
    try:
        dist.barrier()  # NCCL's communicator and buffers exist after a first collective
        baseline = device_baseline_bytes(device)
        figures = {**_network(spec.rank, device, repeats), **_compute(shape, samples, device, repeats),
                   "baseline_bytes": baseline}
        figures.update(tp_figures(shape, device, repeats))
        figures.update(fsdp_figures(shape, device, figures, repeats))
        figures.update(_pipeline(shape, device, figures["rate_by_samples"], repeats, precision))
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
    except BaseException:
        close_session(after_error=True)  # no blocking destroy before the launcher has the report
        raise
    close_session()


def calibrate(shape: LayerShape, *, samples: int = 256, repeats: int = 9, timeout_s: float = 600.0,
              device: str | None = None, precision: str = "fp32", inter: dict[str, float] | None = None) -> Calibration:
    """Measure with two spawned ranks and return the calibration (its `measured` field says when and on what).
    `samples` (>= 4): the largest micro-batch the layer is timed at; `device`: "cpu" or "cuda" (default: as
    `resolve_device`; on CUDA two GPUs are needed, checked before the ranks start); `precision`: "fp32" (TF32
    matmuls on CUDA) or "fp32-strict" (bf16 layers are not measured yet); `inter`: the links across nodes as
    `bench.internode.measure_inter_node` measured them (None: the built-in figures)."""
    if samples < 4:
        raise ValueError(f"calibrate needs samples >= 4, got {samples}")
    if precision not in ("fp32", "fp32-strict"):
        raise ConfigError(f"the calibration measures fp32 layers, not {precision}",
                          hint="calibrate with --precision fp32 or fp32-strict (bf16 calibration is not built)")
    device = resolve_device(device)
    check_local_ranks(2, device, what="the calibration (two ranks: P2P, all-reduce, a 2-stage pipeline)")
    with tempfile.TemporaryDirectory(prefix="pipetrain-calibrate-") as work:
        spawn(_rank, ranks=range(2), world_size=2, master_addr="127.0.0.1", master_port=free_port(),
              args=(shape, samples, repeats, work, precision), timeout_s=timeout_s, device=device)
        m = json.loads(Path(work, "calibration.json").read_text())
    on_gpu = device == "cuda"
    memory = torch.cuda.get_device_properties(0).total_memory if on_gpu else _host_memory()
    device = Device(name=m["device"], flops_per_s=m["flops_per_s"], bytes_per_s=m["bytes_per_s"],
                    kernel_overhead_s=m["kernel_overhead_s"], action_overhead_s=m["action_overhead_s"],
                    optimizer_s_per_param=m["optimizer_s_per_param"],
                    optimizer_s_per_tensor=m["optimizer_s_per_tensor"], memory_bytes=float(memory),
                    activation_factor=m["activation_factor"], contention=m["contention"],
                    pipeline_slowdown=m["pipeline_slowdown"],
                    rate_by_samples=tuple((float(b), r) for b, r in m["rate_by_samples"]),
                    cores=0.0 if on_gpu else float(len(os.sched_getaffinity(0))),
                    baseline_bytes=m["baseline_bytes"],  # CUDA: context, NCCL buffers (device_baseline_bytes)
                    optimizer_s_per_dtensor=m.get("optimizer_s_per_dtensor", 0.0),
                    step_overhead_s=m.get("step_overhead_s", 0.0))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    across = NOT_MEASURED if inter is None else inter_node_description(inter)
    return Calibration(device=device, network=measured_network(m, inter), backend=m["backend"], precision=precision,
                       measured=f"{stamp}, 2 ranks on one node, layer {shape}; {across}")


#: What a calibration on one node does not measure, said in its `measured` field.
NOT_MEASURED = "inter-node links not measured (built-in figures)"


def inter_node_description(inter: dict[str, float]) -> str:
    """What the `measured` field says of measured inter-node links."""
    return (f"inter-node links measured across {inter['inter_nodes']:.0f} nodes: point-to-point "
            f"{inter['inter_bytes_per_s'] / 1e6:.1f} MB/s, {inter['inter_latency_s'] * 1e6:.0f} us; all-reduce bus "
            f"{inter['inter_collective_bytes_per_s'] / 1e6:.1f} MB/s (up to {inter['inter_largest_bytes'] / 2**20:.0f} MiB)")


def measured_network(m: dict[str, float], inter: dict[str, float] | None = None) -> Network:
    """The network of the ranks' figures `m`: point-to-point and collectives as measured on this node; the links
    across nodes as `inter` measured them (`bench.internode`, in a job that spans nodes), else the built-in ones
    (`DEFAULT_NETWORK`'s: two ranks of one node cannot see them)."""
    across = inter or {"inter_latency_s": DEFAULT_NETWORK.inter_latency_s,
                       "inter_bytes_per_s": DEFAULT_NETWORK.inter_bytes_per_s}
    return Network(p2p_latency_s=m["p2p_latency_s"], p2p_bytes_per_s=m["p2p_bytes_per_s"],
                   inter_latency_s=across["inter_latency_s"], inter_bytes_per_s=across["inter_bytes_per_s"],
                   collective_latency_s=m["collective_latency_s"], collective_bytes_per_s=m["collective_bytes_per_s"],
                   inter_collective_latency_s=across.get("inter_collective_latency_s", 0.0),
                   inter_collective_bytes_per_s=across.get("inter_collective_bytes_per_s", 0.0),
                   tp_collective_s=m.get("tp_collective_s", 0.0), fsdp_group_s=m.get("fsdp_group_s", 0.0))


def _host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
