"""torch's fused attention kernels that return the log-sum-exp, forward and backward (private aten ops), for the
ring's block attention: one block of queries over one block of keys and values, and the exact gradient of that
block given the whole attention's output and log-sum-exp.

CPU: `_scaled_dot_product_flash_attention_for_cpu` and its backward (any head dimension; fp32, fp64, bf16, fp16;
an additive mask in the inputs' dtype; key/value heads fewer than query heads (GQA) taken as they are). CUDA: the
memory-efficient kernel, `_scaled_dot_product_efficient_attention` and its backward (an additive `attn_bias`;
head dimension a multiple of 8; key/value heads repeated for GQA, their gradients summed back; its log-sum-exp
padded to a multiple of 32 queries, cut here and padded again for the backward). `fused_supported` says which
inputs these take; other devices and dtypes use the caller's torch-ops attention. `causal`: the top-left causal
mask of a square block, without a bias. The log-sum-exp is [B, H, Lq] in fp32; the output in the inputs' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_supported", "fused_attention", "fused_attention_backward", "repeat_kv", "fold_kv_grad"]

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LSE_ROWS = 32  # the efficient kernel's log-sum-exp is padded to a multiple of this many queries


def fused_supported(q: torch.Tensor) -> bool:
    """Whether the fused kernels take `q`'s device, dtype and head dimension."""
    if q.device.type == "cpu":
        return q.dtype in _CPU_DTYPES
    if q.device.type == "cuda":
        return q.dtype in _CUDA_DTYPES and q.shape[-1] % 8 == 0
    return False


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`k`, `v` with each key/value head repeated for its query heads (GQA), as `q`'s head count."""
    repeat = q.shape[1] // k.shape[1]
    if repeat == 1:
        return k, v
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)


def fold_kv_grad(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """A gradient of repeated key/value heads summed back onto the `heads` heads."""
    b, h, length, d = grad.shape
    return grad if h == heads else grad.reshape(b, heads, h // heads, length, d).sum(dim=2)


def _cuda_bias(bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The efficient kernel's bias: [B, H, Lq, Lk] (broadcast views), its rows 16-element aligned in memory."""
    if bias is None:
        return None
    lk = bias.shape[-1]
    if lk % 16:
        bias = F.pad(bias, (0, 16 - lk % 16))[..., :lk]
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q` [B, H, Lq, D] over `k`, `v` [B, Hkv, Lk, D] with the additive `bias`
    [B or 1, 1, Lq, Lk] (or None) and/or the square `causal` mask: (output [B, H, Lq, D], log-sum-exp [B, H, Lq])."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    k, v = repeat_kv(q, k, v)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _cuda_bias(bias, q, k), True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]]


def fused_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, bias: torch.Tensor | None, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (q, k, v) of the block `fused_attention` computed, given `out` and `lse` [B, H, Lq] (fp32):
    with the whole attention's output and log-sum-exp they are exactly this block's share of the whole's."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    heads = k.shape[1]
    k, v = repeat_kv(q, k, v)
    rows = -(-q.shape[2] // _LSE_ROWS) * _LSE_ROWS
    lse = F.pad(lse, (0, rows - q.shape[2])).contiguous()
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    grad_q, grad_k, grad_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v, _cuda_bias(bias, q, k), out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale)
    return grad_q, fold_kv_grad(grad_k, heads), fold_kv_grad(grad_v, heads)
