"""Grouped matmuls (one kernel for many experts' jagged row blocks): torch's public `grouped_mm` where this torch has
it, else the private `torch._grouped_mm` it grew from; and the shape rules under which either runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["grouped_mm", "grouped_mm_fits"]

#: byte alignment the CPU and CUDA kernels ask of every row stride and data pointer (torch 2.13: "strides should be
#: multiple of 16 bytes", raised in the backward)
ALIGNMENT = 16


def _kernel():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `grouped_mm(rows, weight.transpose(-2, -1), offs)` runs forward and backward for `rows` [R, K] and
    `weight` [G, N, K]: a kernel exists (CUDA: compute capability 8.0 or more), both are floating tensors of one dtype,
    K and N span whole 16-byte units and both start 16-byte aligned."""
    if _kernel() is None or rows.dtype != weight.dtype or not rows.is_floating_point():
        return False
    if weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) < (8, 0):
        return False
    size = rows.element_size()
    inner, outer = weight.shape[-1], weight.shape[-2]
    return (inner * size % ALIGNMENT == 0 and outer * size % ALIGNMENT == 0
            and rows.data_ptr() % ALIGNMENT == 0 and weight.data_ptr() % ALIGNMENT == 0)


def grouped_mm(rows: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`rows[offsets[g-1]:offsets[g]] @ weight_t[g]` for every group g, concatenated; `offsets` int32, cumulative."""
    return _kernel()(rows, weight_t, offs=offsets)
