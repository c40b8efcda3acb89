"""Device and network descriptions for the planner, and the calibration file that stores measured ones.

The calibration file (JSON, `pipetrain-calibration/1`) is written by `pipetrain plan --calibrate` and read
by `plan` and `tune`. Default location: `~/.cache/pipetrain/calibration.json`; `--calibration PATH`
overrides it. Without a file the planner uses `DEFAULT_DEVICE` / `DEFAULT_NETWORK` (an A100-class GPU on
NVLink within a node, 200 Gb/s InfiniBand across nodes) and says so.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.plan.gpus import ALIASES, GPUS

__all__ = ["Device", "Network", "Calibration", "DEFAULT_DEVICE", "DEFAULT_NETWORK", "DEFAULT_RATES", "default_device",
           "default_calibration_path", "load_calibration", "save_calibration", "CALIBRATION_FORMAT", "NODES",
           "SHEET_EFFICIENCY", "gpu_names", "named_gpu"]

CALIBRATION_FORMAT = "pipetrain-calibration/1"


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device: effective FLOP rate, memory traffic rate, per-kernel and per-schedule-action overheads,
    the optimizer's time per parameter and per parameter tensor, its memory, (CPU) the memory a rank uses
    before the model, and the measured peak activation memory over the analytic bytes kept for backward
    (`activation_factor`). Ranks on a CPU share it: `cores` ranks compute at once at full speed (0: each
    rank has its own device), and each of k busy cores runs `1 / (1 + contention * (k - 1))` as fast as one
    alone. Small matrices run below the device's rate: `rate_by_samples` holds the rate a whole layer ran
    at per micro-batch size (its kernel launches and memory traffic included, so blocks with FLOPs pay
    nothing else). A pipeline stage computes `1 + pipeline_slowdown` times as long as the same blocks in a
    single process (measured: the same work handed from rank to rank)."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    kernel_overhead_s: float
    action_overhead_s: float
    optimizer_s_per_param: float
    memory_bytes: float
    optimizer_s_per_tensor: float = 0.0
    baseline_bytes: float = 0.0
    activation_factor: float = 1.0
    cores: float = 0.0
    contention: float = 0.0
    rate_by_samples: tuple[tuple[float, float], ...] = ()
    pipeline_slowdown: float = 0.0
    #: extra seconds of an optimizer step per DTensor parameter (TP-split or FSDP-sharded; bench/calibrate_tp.py)
    optimizer_s_per_dtensor: float = 0.0
    #: device <-> pinned host copy rate of activation offloading (a PCIe 4.0 x16 link's practical rate unless
    #: calibrated; on a CPU device nothing moves)
    host_bytes_per_s: float = 25e9
    #: host seconds once per training step that neither the model nor the schedule's actions set (the batch split,
    #: the loss's global count, the metrics reduced and read back, zero-grad): fitted with `action_overhead_s` from
    #: two measured pipeline steps (plan/overheads.py); 0 unless calibrated
    step_overhead_s: float = 0.0

    def flops_at(self, samples: float) -> float:
        """The effective FLOP rate on a micro-batch of `samples`: `rate_by_samples` (measured sizes, ascending)
        interpolated in log(samples) and constant beyond its ends; `flops_per_s` without it."""
        points = self.rate_by_samples
        if not points:
            return self.flops_per_s
        if samples <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in zip(points, points[1:]):
            if samples <= x1:
                return r0 + (r1 - r0) * math.log(samples / x0) / math.log(x1 / x0)
        return points[-1][1]


@dataclass(frozen=True, kw_only=True)
class Network:
    """Point-to-point latency and bandwidth within and across nodes, and the collectives' (ring) figures: within a
    node, and across nodes (`inter_collective_*`, measured by `plan --calibrate` in a job that spans nodes; 0: the
    point-to-point figures across nodes, `inter_*`, stand for them)."""

    p2p_latency_s: float
    p2p_bytes_per_s: float
    inter_latency_s: float
    inter_bytes_per_s: float
    collective_latency_s: float
    collective_bytes_per_s: float
    #: fixed seconds one tensor-parallel (DTensor) collective costs beyond the ring's latency and bandwidth, per
    #: peer (host dispatch, the wait for the slower rank; bench/calibrate_tp.py); 0 where not measured
    tp_collective_s: float = 0.0
    #: fixed seconds per FSDP2 parameter group and step beyond the ring (copy-in/out, hooks, the slower peer;
    #: bench/calibrate_fsdp.py); 0 where not measured
    fsdp_group_s: float = 0.0
    #: fixed seconds one expert all-to-all call costs beyond the ring's latency and bandwidth, per peer (the split
    #: sizes' host sync, gloo's pairwise sends, the wait for the slower peer; bench/calibrate_ep.py); 0 where not
    #: measured (older calibration files, the data-sheet GPUs)
    ep_all_to_all_s: float = 0.0
    inter_collective_latency_s: float = 0.0
    inter_collective_bytes_per_s: float = 0.0

    def across_collective(self) -> tuple[float, float]:
        """(latency per ring step, bus bandwidth) of a collective whose ranks span nodes."""
        if self.inter_collective_bytes_per_s > 0:
            return self.inter_collective_latency_s, self.inter_collective_bytes_per_s
        return self.inter_latency_s, self.inter_bytes_per_s


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """A measured device and network, with where and how they were measured."""

    device: Device
    network: Network
    backend: str
    measured: str
    #: the training precision the device's rates hold for ("fp32": TF32 matmuls on CUDA, "fp32-strict", "bf16")
    precision: str = "fp32"


DEFAULT_DEVICE = Device(name="gpu-a100-class (assumed)", flops_per_s=150e12, bytes_per_s=1.5e12,
                        kernel_overhead_s=5e-6, action_overhead_s=2e-4, optimizer_s_per_param=1e-11,
                        memory_bytes=80 * 2**30)
#: The built-in device's effective FLOP rate per training precision: an A100-class GPU runs fp32 matmuls in TF32 on
#: CUDA (pipetrain's default; 156 dense TFLOP/s peak), bf16 at twice that, IEEE fp32 ("fp32-strict") at 19.5.
DEFAULT_RATES = {"fp32": 150e12, "bf16": 300e12, "fp32-strict": 19.5e12}


def default_device(precision: str = "fp32") -> Device:
    """The built-in device at the FLOP rate of `precision` (one of `DEFAULT_RATES`)."""
    if precision not in DEFAULT_RATES:
        raise ConfigError(f"precision {precision!r} has no built-in rate", hint=f"use one of {', '.join(DEFAULT_RATES)}")
    return replace(DEFAULT_DEVICE, flops_per_s=DEFAULT_RATES[precision])


DEFAULT_NETWORK = Network(p2p_latency_s=1e-5, p2p_bytes_per_s=150e9, inter_latency_s=5e-6, inter_bytes_per_s=20e9,
                          collective_latency_s=2e-5, collective_bytes_per_s=100e9)


#: The one rule that turns a data sheet (`gpus.GPUS`) into the planner's figures, the rule the A100-class built-in
#: follows: matrix rates at 96 % of the dense peak of the training precision (150 of 156 TFLOP/s for the A100's
#: TF32), HBM at 75 % of its peak; within a node, ring collectives at a bus bandwidth of 80 % of the per-direction
#: link figure (nccl-tests' all-reduce busbw on DGX A100 / H100 without NVLink SHARP is of that order) with 1 µs per
#: ring step, point-to-point at half of it, 10 µs; across nodes the GPU's network card at 80 %, 5 µs.
SHEET_EFFICIENCY = {"flops": 0.96, "hbm": 0.75, "collective": 0.80, "p2p": 0.5, "nic": 0.80}
_PEAK_FIELD = {"bf16": "bf16_flops", "fp32": "tf32_flops", "fp32-strict": "fp32_flops"}


def gpu_names() -> tuple[str, ...]:
    """The names `--gpu` takes (`gpus.GPUS` and its aliases)."""
    return tuple(GPUS) + tuple(ALIASES)


def named_gpu(name: str, precision: str = "fp32") -> tuple[Device, Network]:
    """The planner's device and network for the GPU `name` (a key of `gpus.GPUS` or an alias) at `precision`."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ConfigError(f"unknown GPU {name!r}", hint=f"choose one of: {', '.join(GPUS)}")
    if precision not in _PEAK_FIELD:
        raise ConfigError(f"precision {precision!r} has no data-sheet rate", hint=f"use one of {', '.join(_PEAK_FIELD)}")
    gpu, k = GPUS[key], SHEET_EFFICIENCY
    device = Device(name=f"{gpu.name} (data sheet)", flops_per_s=getattr(gpu, _PEAK_FIELD[precision]) * k["flops"],
                    bytes_per_s=gpu.hbm_bytes_per_s * k["hbm"], kernel_overhead_s=gpu.kernel_overhead_s,
                    action_overhead_s=2e-4, optimizer_s_per_param=gpu.optimizer_s_per_param,
                    memory_bytes=gpu.memory_gb * 2**30)
    network = Network(p2p_latency_s=1e-5, p2p_bytes_per_s=gpu.link_bytes_per_s * k["p2p"], inter_latency_s=5e-6,
                      inter_bytes_per_s=gpu.nic_bytes_per_s * k["nic"], collective_latency_s=1e-6,
                      collective_bytes_per_s=gpu.link_bytes_per_s * k["collective"])
    return device, network


#: Named GPU nodes at fp32 (TF32 matmuls) for what-if tables (`python benchmarks/tp_table.py`): `named_gpu` of the
#: A100 SXM 80 GB and the H100 SXM (kept under their older names "a100" and "h100").
NODES: dict[str, tuple[Device, Network]] = {"a100": named_gpu("a100-80gb"), "h100": named_gpu("h100-sxm")}


def default_calibration_path() -> Path:
    """`~/.cache/pipetrain/calibration.json`."""
    return Path.home() / ".cache" / "pipetrain" / "calibration.json"


def _numbers(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not an object")
    values = {}
    for field in fields(cls):
        value = data.get(field.name, None if field.default is MISSING else field.default)
        if field.name == "name":
            values["name"] = str(value if value is not None else "calibrated")
            continue
        if field.name == "rate_by_samples":
            values[field.name] = _pairs(value, f"{where}.{field.name}")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}.{field.name} is {value!r}, expected a number >= 0")
        values[field.name] = float(value)
    return cls(**values)


def _pairs(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    """[[samples, FLOP/s], ...] with positive numbers and ascending samples."""
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in pair)
        for pair in value)
    if not ok or any(a[0] >= b[0] for a, b in zip(value, value[1:])):
        raise ValueError(f"{where} is {value!r}, expected [[samples, FLOP/s], ...] with ascending samples")
    return tuple((float(a), float(b)) for a, b in value)


def load_calibration(path: Path) -> Calibration:
    """Read a calibration file; ConfigError naming the file and the problem when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
            raise ValueError(f"its format is not {CALIBRATION_FORMAT!r}")
        return Calibration(device=_numbers(Device, data.get("device"), "device"),
                           network=_numbers(Network, data.get("network"), "network"),
                           backend=str(data.get("backend", "?")), measured=str(data.get("measured", "?")),
                           precision=str(data.get("precision", "fp32")))
    except OSError as err:
        raise ConfigError(f"cannot read the calibration file {str(path)!r}: {err.strerror}",
                          hint="run `pipetrain plan --calibrate` first, or pass --calibration PATH") from None
    except ValueError as err:
        raise ConfigError(f"the calibration file {str(path)!r} is malformed: {err}",
                          hint="run `pipetrain plan --calibrate` again to rewrite it") from None


def save_calibration(calibration: Calibration, path: Path) -> None:
    """Write atomically (a temporary file renamed over `path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": CALIBRATION_FORMAT, "backend": calibration.backend, "measured": calibration.measured,
            "precision": calibration.precision, "device": asdict(calibration.device), "network": asdict(calibration.network)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
