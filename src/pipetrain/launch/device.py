"""Which device the ranks run on: the user's choice (`--device`, PIPETRAIN_DEVICE) or CUDA when present, and the
check, before any rank starts, that no two ranks of one node would share a GPU (NCCL refuses them:
"Duplicate GPU detected", NVIDIA/nccl#1241).

Only `torch.cuda`'s counting functions are used here (no process group), so the checks run, and are tested with
a patched device count, on a machine without a GPU.
"""

from __future__ import annotations

import torch

from pipetrain.errors import ConfigError
from pipetrain.launch.env import DEVICE_VARIABLE, DEVICES, device_override

__all__ = ["DEVICES", "resolve_device", "check_local_ranks", "pick_device", "gpu_count"]


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(choice: str | None = None, *, flag: str = "--device") -> str:
    """The device type of the job: `choice` (the `--device` flag), else PIPETRAIN_DEVICE, else "cuda" when CUDA
    is available, else "cpu". Raises `ConfigError` for an unknown type, a flag that contradicts PIPETRAIN_DEVICE
    (the launcher's choice), and "cuda" without CUDA."""
    if choice is not None and choice not in DEVICES:
        raise ConfigError(f"{flag} {choice!r} is not a device type", hint=f"pass {flag} {' or '.join(DEVICES)}")
    pinned = device_override()
    if choice is not None and pinned is not None and choice != pinned:
        raise ConfigError(f"{flag} {choice} contradicts {DEVICE_VARIABLE}={pinned} set by the launcher or job script",
                          hint=f"drop {flag}, or unset {DEVICE_VARIABLE} or set it to {choice}")
    wanted = choice or pinned
    source = f"{flag} cuda" if choice else f"{DEVICE_VARIABLE}=cuda"
    if wanted == "cuda" and gpu_count() == 0:
        built = torch.version.cuda
        why = f"this torch {torch.__version__} is a CPU-only build" if built is None else (
            f"torch {torch.__version__} (CUDA {built}) finds no CUDA device (driver, CUDA_VISIBLE_DEVICES?)")
        raise ConfigError(f"{source} but {why}", hint=f"run on a GPU node, or use {flag} cpu")
    return wanted or ("cuda" if gpu_count() else "cpu")


def check_local_ranks(local_ranks: int, device: str, *, what: str = "this job") -> None:
    """Refuse, before spawning, `local_ranks` ranks on this node when `device` is "cuda" and fewer GPUs are visible:
    two ranks would drive one GPU, which NCCL refuses after every rank has started."""
    if device != "cuda":
        return
    gpus = gpu_count()
    if local_ranks > gpus:
        raise ConfigError(
            f"{what} runs {local_ranks} ranks on this node but it has {gpus} GPU(s): two ranks would share a GPU, "
            "which NCCL refuses ('Duplicate GPU detected')",
            hint=f"use at most {gpus} ranks per node (e.g. lower --pp/--dp), or run on the CPU with --device cpu")


def pick_device(local_rank: int, choice: str | None = None) -> torch.device:
    """This rank's device: `cuda:<local_rank>` on CUDA (modulo the visible GPUs: a rank bound to its own GPU, e.g.
    by Slurm, sees one), else the CPU; `choice` as for `resolve_device`."""
    if resolve_device(choice) == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
