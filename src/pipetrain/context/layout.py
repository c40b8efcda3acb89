"""The zig-zag layout of a sequence over the ranks of a context-parallel group: which tokens each rank holds.

The sequence is cut into 2N equal parts; rank i of N holds part i and part 2N-1-i, one from the front and one from
the back, so that under a causal mask every rank has the same amount of attention to compute (Megatron-Core's and
torchtitan's load balance). Pure tensor arithmetic: no process group.
"""

from __future__ import annotations

import torch

from pipetrain.errors import ConfigError

__all__ = ["check_length", "zigzag_index", "zigzag_split", "shift_targets"]


def check_length(length: int, cp: int) -> None:
    """Raise unless a sequence of `length` tokens cuts into the 2 * cp equal zig-zag parts."""
    parts = 2 * cp
    if length % parts:
        below, above = length - length % parts, length + parts - length % parts
        near = f"{below} or {above}" if below else f"{above} or {above + parts}"
        raise ConfigError(
            f"sequence length {length} does not cut into 2 x cp = {parts} equal zig-zag parts (--cp {cp})",
            hint=f"use a sequence length that is a multiple of {parts} (e.g. {near}), or another --cp",
        )


def zigzag_index(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global indices (in order) of the `length // cp` tokens rank `rank` holds of a `length`-token sequence."""
    check_length(length, cp)
    part = length // (2 * cp)
    front = torch.arange(rank * part, (rank + 1) * part, device=device)
    back = torch.arange((2 * cp - 1 - rank) * part, (2 * cp - rank) * part, device=device)
    return torch.cat([front, back])


def zigzag_split(tensor: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `tensor` along its sequence dimension `dim` (contiguous)."""
    index = zigzag_index(tensor.shape[dim], cp, rank, tensor.device)
    return tensor.index_select(dim, index).contiguous()


def shift_targets(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Next-token targets as they must be before the split: position t holds token t + 1, the last position
    `ignore_index` (a loss that shifts by itself would lose one token at every part boundary)."""
    shifted = torch.full_like(targets, ignore_index)
    shifted[:, :-1] = targets[:, 1:]
    return shifted
