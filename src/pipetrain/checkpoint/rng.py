"""The random-number streams a checkpoint keeps, one key per generator: the CPU's (`rng.rank<R>`, 5,056 bytes) and,
where this rank has used CUDA, its device's Philox state (`rng_cuda.rank<R>`, 16 bytes on torch 2.13).

Two keys rather than one stacked tensor: the two states have different shapes (the old stacked form silently kept
only the CPU's). A checkpoint written on CUDA loads on the CPU (its CUDA key is left unread), and one written on the
CPU loads on CUDA (no CUDA key: the device stream stays as seeded, and `restore_rng` says so by returning False).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

__all__ = ["CPU_KEY", "CUDA_KEY", "rng_key", "cuda_rng_key", "rng_state", "rng_targets", "restore_rng"]

CPU_KEY = "rng.rank{rank}"
CUDA_KEY = "rng_cuda.rank{rank}"


def rng_key(rank: int) -> str:
    """The key of rank `rank`'s CPU generator state."""
    return CPU_KEY.format(rank=rank)


def cuda_rng_key(rank: int) -> str:
    """The key of rank `rank`'s CUDA generator state (its current device's)."""
    return CUDA_KEY.format(rank=rank)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def rng_state(rank: int) -> dict[str, torch.Tensor]:
    """The generator states of this rank to save: the CPU's, and the current CUDA device's once CUDA is in use."""
    state = {rng_key(rank): torch.get_rng_state()}
    if _cuda_in_use():
        state[cuda_rng_key(rank)] = torch.cuda.get_rng_state()
    return state


def rng_targets(rank: int, saved: Collection[str]) -> dict[str, torch.Tensor]:
    """The tensors `dcp.load` fills with this rank's saved generator states: those among `saved` (the checkpoint's
    keys) that this process can restore (a CUDA state only where CUDA is in use)."""
    return {key: value for key, value in rng_state(rank).items() if key in saved}


def restore_rng(state: Mapping[str, torch.Tensor], rank: int) -> bool:
    """Set this rank's generators from `state` (filled by `dcp.load`); True when every generator in use was restored
    (False: a CPU checkpoint resumed on CUDA leaves the CUDA stream as seeded)."""
    cpu = state.get(rng_key(rank))
    if cpu is not None:
        torch.set_rng_state(cpu[0] if cpu.dim() > 1 else cpu)  # [0]: the stacked form of older checkpoints
    cuda = state.get(cuda_rng_key(rank))
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    return cpu is not None and (cuda is not None or not _cuda_in_use())
