"""Targets that carry numbers beside the labels: float64 columns stored bit for bit in an int64 tensor.

The pipeline engine hands the last stage one target tensor per micro-batch, cut along the batch dimension. An
objective whose loss needs per-sequence numbers (reference log-probabilities, advantages, old log-probabilities)
appends them to the integer labels as extra columns: each float64 value is kept exactly as its 64 bits
(`Tensor.view(torch.int64)`), so the labels stay integers and every number reaches the loss unrounded, cut into
micro-batches with its row.
"""

from __future__ import annotations

import torch

__all__ = ["with_columns", "split_columns"]


def with_columns(labels: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`labels` `[batch, seq]` (int64) followed by `columns` `[batch, k]` (converted to float64), as int64
    `[batch, seq + k]`."""
    if columns.dim() == 1:
        columns = columns[:, None]
    bits = columns.to(torch.float64).contiguous().view(torch.int64)
    return torch.cat([labels.to(torch.int64), bits.to(labels.device)], dim=1)


def split_columns(targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels `[batch, seq]` and the `k` float64 columns `[batch, k]` of targets made by `with_columns`."""
    return targets[:, :-k], targets[:, -k:].contiguous().view(torch.float64)
