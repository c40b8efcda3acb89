"""Model FLOPs utilisation (pure arithmetic): model FLOPs per token by the PaLM convention, and peak FLOP/s of a GPU.

Convention (PaLM, Chowdhery et al. 2022, appendix B): one training token costs ``6·N + 12·L·H·Q·T`` FLOPs,
where

- ``N`` is the number of parameters **excluding embedding tables** (token and learned position embeddings
  are lookups, not matrix multiplies). Every other parameter counts once: attention and MLP weights, norms,
  biases, and the output projection of the head (a matmul of the hidden state by the vocabulary or the
  classes; pipetrain's head is its own block, so it counts even where a model ties it to the embedding, while
  PaLM, whose output layer is the tied embedding, leaves it out). ``6·N`` is 2 FLOPs per weight and token for
  the forward (multiply + add) and 4 for the backward (gradients of activations and of weights).
- ``12·L·H·Q·T`` is the attention itself: per layer the scores ``Q·Kᵀ`` and the weighted sum of the values,
  each 2·H·Q·T FLOPs per token forward, times 3 for forward + backward. ``L`` layers, ``H`` heads of
  dimension ``Q`` (``H·Q`` is the attention width), ``T`` the sequence length of the batch.

Recomputation (activation checkpointing) is *not* counted: MFU measures useful model FLOPs, not what the
hardware executed. The tokens of a step are the positions the model processes, ``samples × T``, padding
included. MFU = achieved model FLOP/s ÷ peak FLOP/s of all devices of the job.

Peak figures are dense (no sparsity) tensor-core bf16 and plain fp32 (torch's default fp32 matmul does not
use TF32), in TFLOP/s per GPU, from NVIDIA's data sheets; pass ``--peak-tflops`` for any other device.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelFlops", "PEAK_TFLOPS", "peak_tflops", "mfu"]


@dataclass(frozen=True, kw_only=True)
class ModelFlops:
    """What the PaLM formula needs of a model: `params` (N, embeddings excluded), `layers` (L), `heads` (H)
    and `head_dim` (Q)."""

    params: int
    layers: int
    heads: int
    head_dim: int

    def per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) of one token in a sequence of `seq_len` tokens."""
        return 6.0 * self.params + 12.0 * self.layers * self.heads * self.head_dim * seq_len

    def per_step(self, samples: int, seq_len: int) -> float:
        """Training FLOPs of a step over `samples` sequences of `seq_len` tokens."""
        return self.per_token(seq_len) * samples * seq_len


#: Dense peak TFLOP/s per GPU by precision; names are matched in this order against the device's name. "fp32" runs
#: its matmuls in TF32 on CUDA (pipetrain's default there), "fp32-strict" in IEEE fp32 (NVIDIA's datasheets).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 495.0, "fp32-strict": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp32": 378.0, "fp32-strict": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp32": 418.0, "fp32-strict": 60.0},
    "H100": {"bf16": 989.0, "fp32": 495.0, "fp32-strict": 67.0},  # SXM
    "A100": {"bf16": 312.0, "fp32": 156.0, "fp32-strict": 19.5},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak TFLOP/s of one GPU named `device_name` (e.g. "NVIDIA H100 80GB HBM3") at `precision`
    ("bf16", "fp32" (TF32 matmuls) or "fp32-strict"); None for a device or precision not in `PEAK_TFLOPS`."""
    name = device_name.upper()
    for key, peaks in PEAK_TFLOPS.items():
        if all(part.upper() in name for part in key.split()):
            return peaks.get(precision)
    return None


def mfu(flops_per_step: float, step_time_s: float, *, devices: int, peak_tflops_per_device: float) -> float:
    """Model FLOPs utilisation of a step: (`flops_per_step` / `step_time_s`) ÷ (`devices` × peak)."""
    if step_time_s <= 0 or devices < 1 or peak_tflops_per_device <= 0:
        raise ValueError(f"MFU needs a positive step time, device count and peak, got {step_time_s}, {devices}, "
                         f"{peak_tflops_per_device}")
    return flops_per_step / step_time_s / (devices * peak_tflops_per_device * 1e12)
