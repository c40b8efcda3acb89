"""Which device figures a plan uses: measured now (`--calibrate`), a calibration file, a named GPU's data sheet
(`--gpu NAME`), or the built-in A100-class figures; the plan's first lines say which."""

from __future__ import annotations

import argparse
import logging
import warnings

from pipetrain.cli.device_args import device_choice
from pipetrain.errors import ConfigError
from pipetrain.launch.env import without_launcher_variables
from pipetrain.plan.gpus import ALIASES
from pipetrain.plan.hardware import (DEFAULT_NETWORK, Calibration, default_calibration_path, default_device,
                                     load_calibration, named_gpu, save_calibration)
from pipetrain.workloads.classifier.presets import PRESETS

__all__ = ["calibration"]

log = logging.getLogger("pipetrain")
_GB = 2**30


def _named_gpu(args: argparse.Namespace) -> str | None:
    """`--gpu NAME`, or the deprecated `--gpu-node NAME` (a warning names its replacement)."""
    gpu, node = getattr(args, "gpu", None), getattr(args, "gpu_node", None)
    if node is None:
        return gpu
    if gpu is not None:
        raise ConfigError("--gpu and --gpu-node both name the GPU", hint="pass --gpu alone")
    replacement = ALIASES.get(node, node)
    warnings.warn(f"--gpu-node {node} is deprecated: pass --gpu {replacement}", DeprecationWarning, stacklevel=2)
    log.warning("--gpu-node %s is deprecated: pass --gpu %s (the same data-sheet figures)", node, replacement)
    return replacement


def _sheet(gpu: str, precision: str, why: str = "") -> tuple[Calibration, str]:
    device, network = named_gpu(gpu, precision)
    return (Calibration(device=device, network=network, backend="nccl (assumed)", measured="data sheet",
                        precision=precision),
            f"{device.name} at {precision}: {device.flops_per_s / 1e12:.0f} TFLOP/s effective, "
            f"{device.memory_bytes / _GB:.0f} GB (pipetrain/plan/gpus.py){why}")


def _on_cpu(calib: Calibration) -> bool:
    return calib.device.name.startswith("cpu")


def calibration(args: argparse.Namespace) -> tuple[Calibration, str]:
    """The calibration to plan with, and where it came from: measured now (`--calibrate`); the data sheet of a GPU
    named with `--gpu` unless `--calibration FILE` names one made on it; the calibration file; or the built-in
    A100-class figures. A plan for GPUs of a stated memory (`--gpu-mem`) never takes this machine's CPU calibration
    from its default place for them."""
    gpu, given = _named_gpu(args), args.calibration is not None
    if gpu is not None and args.calibrate:
        raise ConfigError(f"--gpu {gpu} plans on a data sheet and --calibrate measures this machine",
                          hint="pass one of them")
    if gpu is not None and not given:
        return _sheet(gpu, args.precision)
    path = args.calibration or default_calibration_path()
    if args.calibrate:
        from pipetrain.bench.calibrate import calibrate

        c = PRESETS[args.preset or "cpu"] if (args.preset or "cpu") in PRESETS else PRESETS["cpu"]
        log.info("calibrating this machine (2 ranks)...")
        inter = getattr(args, "inter_node", None)  # measured by `run` in a job that spans nodes
        with without_launcher_variables():  # its 2 ranks are a job of their own (torchrun's store is not theirs)
            measured = calibrate(dict(seq_len=c.seq_len, emsize=c.emsize, nhead=c.nhead, nhid=c.nhid,
                                      dropout=c.dropout), device=device_choice(args), precision=args.precision,
                                 inter=inter)
        save_calibration(measured, path)
        return measured, f"measured now at {args.precision}, stored in {path}"
    if path.exists() or given:
        loaded = load_calibration(path)
        if gpu is not None and _on_cpu(loaded):
            raise ConfigError(f"--calibration {str(path)!r} was measured on a CPU, not on the --gpu {gpu} it plans",
                              hint=f"drop --calibration to plan on the {gpu} data sheet, or pass a calibration "
                                   f"made on that GPU (`pipetrain plan --calibrate` on its node)")
        if not given and args.gpu_mem is not None and _on_cpu(loaded):
            return (Calibration(device=default_device(args.precision), network=DEFAULT_NETWORK,
                                backend="nccl (assumed)", measured="built-in", precision=args.precision),
                    f"built-in A100-class figures at {args.precision}: {path} holds this machine's CPU, not GPUs "
                    f"of {args.gpu_mem:g} GB (pass --gpu NAME for a data sheet, or --calibration FILE made on them)")
        if loaded.precision != args.precision:
            raise ConfigError(f"the calibration {str(path)!r} holds {loaded.precision} rates, this plan is for "
                              f"--precision {args.precision}",
                              hint=f"pass --precision {loaded.precision}, or measure again with --calibrate "
                                   f"--precision {args.precision}")
        return loaded, f"{path} ({loaded.measured}, {loaded.precision})"
    return (Calibration(device=default_device(args.precision), network=DEFAULT_NETWORK, backend="nccl (assumed)",
                        measured="built-in", precision=args.precision),
            f"built-in A100-class figures at {args.precision} (no calibration file; see --calibrate, or --gpu NAME)")
