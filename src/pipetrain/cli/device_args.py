"""The `--device cpu|cuda` flag of the verbs that run ranks (train, bench, profile, plan --calibrate, tune), and the
device it resolves to (`pipetrain sbatch` renders its own, for the job's nodes rather than this machine)."""

from __future__ import annotations

import argparse

from pipetrain.launch.env import DEVICE_VARIABLE, DEVICES, ClusterEnv

__all__ = ["add_device_argument", "device_choice"]


def add_device_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add `--device` to `parser` (or one of its argument groups)."""
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help=f"run every rank on this device type (default: {DEVICE_VARIABLE} if set, else cuda "
                             "when a GPU is visible, else cpu)")


def device_choice(args: argparse.Namespace, env: ClusterEnv | None = None, *, local_ranks: int | None = None) -> str:
    """The validated device type of parsed arguments ("cpu" or "cuda"): `--device`, PIPETRAIN_DEVICE or the default.

    Raises `ConfigError` for cuda without a GPU, for a flag that contradicts PIPETRAIN_DEVICE, and on CUDA for
    more ranks on this node than GPUs: the `local_ranks` about to be spawned here, or the ranks torchrun started
    (`env`; torchrun never binds a GPU to a rank; Slurm may, so srun's tasks are not counted)."""
    from pipetrain.launch.device import check_local_ranks, resolve_device  # torch: not at import (plan starts fast)

    device = resolve_device(getattr(args, "device", None))
    if local_ranks is not None:
        check_local_ranks(local_ranks, device)
    if env is not None and env.source == "torchrun":
        check_local_ranks(env.local_world_size, device, what=f"torchrun (LOCAL_WORLD_SIZE={env.local_world_size})")
    return device
