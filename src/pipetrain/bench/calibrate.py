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
  fixed cost per parameter group beyond the ring (`calibrate_fsdp.py`); pipetrain's expert dispatch and combine
  of one sequence: the fixed cost per all-to-all call beyond the ring (`calibrate_ep.py`);
- AdamW's time per parameter (one large tensor) and per parameter tensor (many small ones);
- a 2-stage pipeline of 4 such layers against the simulator (`calibrate_pipeline.py`): the slowdown of work handed
  from rank to rank, the host cost of one schedule action and the engine's fixed cost per step (its 1- and
  16-micro-batch steps, `plan/overheads.py`);
- the rank's memory before any model (CPU: RSS), and the activation factor: a layer's peak memory growth
  per sample over the bytes the analytic model says it keeps for backward (CPU: resident memory, whose
  peak also holds backward transients and freed blocks).

Each timing is a median of repeats; ratios are medians of pairs measured in alternation.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.bench.calibrate_device import compute_figures, network_figures
from pipetrain.bench.calibrate_ep import ep_figures
from pipetrain.bench.calibrate_fsdp import fsdp_figures
from pipetrain.bench.calibrate_pipeline import pipeline_figures
from pipetrain.bench.calibrate_timing import LayerShape
from pipetrain.bench.calibrate_tp import tp_figures
from pipetrain.launch.memory import device_baseline_bytes
from pipetrain.errors import ConfigError
from pipetrain.launch.device import check_local_ranks, resolve_device
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.pipeline.precision import set_fp32_matmuls
from pipetrain.plan.hardware import DEFAULT_NETWORK, Calibration, Device, Network
from pipetrain.session import close_session, join_job

__all__ = ["calibrate", "LayerShape", "measured_network", "NOT_MEASURED", "inter_node_description"]



def _rank(spec: RankSpec, shape: LayerShape, samples: int, repeats: int, out: str, precision: str = "fp32") -> None:
    device = join_job(spec)
    set_fp32_matmuls(device, precision)  # the arithmetic training at `precision` uses (TF32 or IEEE on CUDA)
    try:
        dist.barrier()  # NCCL's communicator and buffers exist after a first collective
        baseline = device_baseline_bytes(device)
        figures = {**network_figures(spec.rank, device, repeats), **compute_figures(shape, samples, device, repeats),
                   "baseline_bytes": baseline}
        figures.update(tp_figures(shape, device, repeats))
        figures.update(fsdp_figures(shape, device, figures, repeats))
        figures.update(ep_figures(shape, device, figures, repeats))
        figures.update(pipeline_figures(shape, device, figures["rate_by_samples"], repeats, precision))
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
                   tp_collective_s=m.get("tp_collective_s", 0.0), fsdp_group_s=m.get("fsdp_group_s", 0.0),
                   ep_all_to_all_s=m.get("ep_all_to_all_s", 0.0))


def _host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
