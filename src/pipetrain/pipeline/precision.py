"""Mixed precision of a stage: bf16 autocast around each stage module, fp32 weights, fp32 tensors between stages;
and the arithmetic of fp32 matmuls on CUDA: TF32 for "fp32" (and the fp32 parts of "bf16"), IEEE for "fp32-strict"
(on an H200 about 495 against 67 dense TFLOP/s; the CPU has one fp32)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipetrain.config.choices import PRECISION_NAMES, check_precision
from pipetrain.errors import ConfigError

__all__ = ["PRECISIONS", "check_precision", "compute_dtype", "AutocastStage", "autocast", "set_fp32_matmuls",
           "to_fp32"]

#: Precision name -> dtype of the autocast region (None: plain fp32, no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {name: {"bf16": torch.bfloat16}.get(name) for name in PRECISION_NAMES}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of `precision` (None for fp32)."""
    return PRECISIONS[check_precision(precision)]


def set_fp32_matmuls(device: torch.device | str, precision: str) -> str:
    """On CUDA, make this process's fp32 matmuls and convolutions TF32 ("tf32") or strict IEEE fp32 ("ieee", for
    "fp32-strict"); returns the mode set ("" elsewhere: the CPU is left as it is)."""
    check_precision(precision)
    if torch.device(device).type != "cuda":
        return ""
    mode = "ieee" if precision == "fp32-strict" else "tf32"
    torch.backends.cuda.matmul.fp32_precision = mode  # torch >= 2.9's API (mixing it with allow_tf32 is an error)
    torch.backends.cudnn.conv.fp32_precision = mode
    return mode


def autocast(device: torch.device | str, precision: str) -> torch.autocast:
    """The autocast context of `precision` on `device` (disabled for fp32): the same region a stage runs in.

    Use it for the single-process reference a pipelined run is compared with.
    """
    dtype = compute_dtype(precision)
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)


def to_fp32(value: Any, low: torch.dtype) -> Any:
    """`value` with every `low`-dtype tensor (also inside tuples, lists and dicts) cast to fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype == low else value
    if isinstance(value, (tuple, list)):
        return type(value)(to_fp32(item, low) for item in value)
    if isinstance(value, dict):
        return {key: to_fp32(item, low) for key, item in value.items()}
    return value


class AutocastStage(nn.Module):
    """Runs `module` under autocast to `precision` while its parameters (and so the optimizer state) stay fp32.

    Outputs that autocast made low-precision are cast back to fp32: the tensors crossing a stage boundary
    keep the dtype pipetrain inferred for them on the meta device (receive buffers are allocated from it);
    the last stage's loss (`pipeline.head.LossHead`, inside this forward) casts them so, outside autocast.
    Activation recomputation re-runs the forward under the same autocast state (torch's checkpoint
    restores it), so recomputed activations equal the first ones.
    """

    def __init__(self, module: nn.Module, precision: str, device_type: str) -> None:
        super().__init__()
        dtype = compute_dtype(precision)
        if dtype is None:
            raise ConfigError(f"AutocastStage needs a reduced precision, got {precision!r}",
                              hint="do not wrap fp32 stages")
        self.module = module
        self.precision = precision
        self.device_type = device_type
        self._dtype = dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self._dtype):
            out = self.module(*args, **kwargs)
        return to_fp32(out, self._dtype)
