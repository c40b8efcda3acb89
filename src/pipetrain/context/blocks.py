"""The ring's block attention: one query part over one key/value part, forward (output and log-sum-exp) and the
exact backward of that block given the whole attention's output and log-sum-exp (FlashAttention's backward: with
D = rowsum(dO * O) of the final O, each block's gradient terms are exact, and the merge needs no gradient of its
own), plus the exact merge of two partial attentions of the same queries.

Two kernels, one interface: "fused" runs torch's fused attention kernel (`compat.attention_kernels`: the CPU flash
kernel, CUDA's memory-efficient one), a block's mask given to it as an additive bias (-1e30 where masked; a square
causal block as the kernel's own causal mask); "ops" writes the attention in torch ops (fp32 scores, recomputed in
the backward). The fused kernel expresses every mask the ring has (causal, sliding window, documents), so "ops"
runs only where `fused_supported` says no (devices other than CPU and CUDA; other dtypes; on CUDA a head dimension
that is not a multiple of 8), or when chosen (`ContextParallel.kernel`, for measuring). Both work without autograd:
the ring's one autograd function calls them.
"""

from __future__ import annotations

import torch

from pipetrain.compat.attention_kernels import (fold_kv_grad, fused_attention, fused_attention_backward,
                                                fused_supported, repeat_kv)

__all__ = ["KERNELS", "BlockKernel", "block_kernel", "merge_"]

#: the block attention's kernels: torch's fused kernel (the default), or torch ops (the fallback)
KERNELS = ("fused", "ops")

#: the score (or bias) of a masked pair: exp() of it against any real score is 0, and a wholly masked row stays
#: finite (a -inf bias would give the fused kernel a log-sum-exp of 0 for such a row)
_MASKED = -1e30

Mask = torch.Tensor | None  # [B or 1, 1, Lq, Lk] booleans (True: attend), or None: all visible


class BlockKernel:
    """The torch-ops block attention; `FusedKernel` the fused one. `q` [B, H, Lq, D], `k`, `v` [B, Hkv, Lk, D]
    (GQA: H a multiple of Hkv); outputs [B, H, Lq, D] and log-sum-exps [B, H, Lq] (fp32)."""

    name = "ops"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output (fp32) and log-sum-exp."""
        k, v = repeat_kv(q, k, v)
        scores = _scores(q, k, mask, scale)
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, mask: Mask, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's gradients (fp32) of q, k, v, given the whole attention's `out` and `lse`."""
        heads = k.shape[1]
        k, v = repeat_kv(q, k, v)
        grad_out = grad_out.float()
        probs = torch.exp(_scores(q, k, mask, scale) - lse.unsqueeze(-1))
        grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
        grad_probs = torch.matmul(grad_out, v.float().transpose(-1, -2))
        # d out / d scores: P * (dP - rowsum(dO * O))
        grad_scores = probs * (grad_probs - (grad_out * out.float()).sum(dim=-1, keepdim=True)) * scale
        grad_q = torch.matmul(grad_scores, k.float())
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.float())
        return grad_q, fold_kv_grad(grad_k, heads), fold_kv_grad(grad_v, heads)


class FusedKernel(BlockKernel):
    """torch's fused attention kernel (outputs and gradients in the inputs' dtype)."""

    name = "fused"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        bias, causal = _bias(mask, q.dtype)
        return fused_attention(q, k.to(q.dtype), v.to(q.dtype), bias, causal, scale)

    def backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, mask: Mask, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bias, causal = _bias(mask, q.dtype)
        return fused_attention_backward(grad_out.to(q.dtype), q, k.to(q.dtype), v.to(q.dtype), out.to(q.dtype), lse,
                                        bias, causal, scale)


def block_kernel(name: str, q: torch.Tensor) -> BlockKernel:
    """The kernel `name` ("fused" or "ops") for `q`'s device and dtype: "ops" where the fused one cannot run."""
    return FusedKernel() if name == "fused" and fused_supported(q) else BlockKernel()


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's partial attention into `out` [.., L, D] and `lse` [.., L] (fp32, in place): exact."""
    total = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - total).unsqueeze(-1))
    lse.copy_(total)


def _bias(mask: Mask, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
    """A boolean block mask as the fused kernel takes it: (additive bias or None, causal)."""
    if mask is None:
        return None, False
    lq, lk = mask.shape[-2:]
    if lq == lk and torch.equal(mask, _causal(lq, mask.device).expand_as(mask)):
        return None, True  # exactly the causal triangle, every row of the batch: the kernel's own mask
    masked = max(_MASKED, torch.finfo(dtype).min)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, masked), False


def _causal(length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def _scores(q: torch.Tensor, k: torch.Tensor, mask: Mask, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, _MASKED)


