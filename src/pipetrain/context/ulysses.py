"""All-to-all (Ulysses) attention: sequence-sharded queries, keys and values become head-sharded by one all-to-all,
each rank attends its heads over the whole sequence, and a second all-to-all gives the output back by sequence.

Needs the query heads and the key/value heads (GQA) to divide by the group's size N (`check_heads`). The all-to-alls
are an autograd function (an even all-to-all's backward is the same all-to-all of the gradients), so the backward
is exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetrain.errors import ConfigError
from pipetrain.pipeline.timeline import span

__all__ = ["ulysses_attention", "check_heads", "all_to_all_single"]


def check_heads(heads: int, kv_heads: int, cp: int, tp: int = 1) -> None:
    """Raise unless `heads` query heads and `kv_heads` key/value heads (a tp rank's share of them under tensor
    parallelism, `tp`) both divide by `cp`."""
    local, local_kv = heads // tp, kv_heads // tp
    if local % cp or local_kv % cp:
        fits = [n for n in range(1, local_kv + 1) if local % n == 0 and local_kv % n == 0]
        held = f" ({local} and {local_kv} per rank of tp={tp})" if tp > 1 else ""
        raise ConfigError(
            f"--cp-attention ulysses at cp={cp} splits the heads over the ranks, but the model has {heads} query "
            f"and {kv_heads} key/value heads{held}, not both divisible by {cp}",
            hint=f"pass --cp among {', '.join(map(str, fits))}, or --cp-attention ring (any cp)",
        )


class _AllToAll(torch.autograd.Function):
    """An even all-to-all over dimension 0 (chunk g to rank g); backward: the same exchange of the gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        with span("cp_all_to_all"):  # a span of a traced step
            dist.all_to_all_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # first: empty_like keeps a permuted gradient's strides, the exchange writes rows
        out = torch.empty_like(grad)
        with span("cp_all_to_all"):
            dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def all_to_all_single(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk g of `tensor`'s dimension 0 to rank g of `group`, in exchange for its chunk of ours; differentiable."""
    return _AllToAll.apply(tensor, group)


def _to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[B, H, L, D] by sequence -> [B, H/N, N*L, D] by heads (the sequence in the ranks' order)."""
    b, h, length, d = x.shape
    sent = x.permute(1, 0, 2, 3).contiguous()  # [H, B, L, D]: rank g gets heads g*H/N ...
    got = all_to_all_single(sent, group)  # [N (source), H/N, B, L, D] flattened
    got = got.reshape(size, h // size, b, length, d)
    return got.permute(2, 1, 0, 3, 4).reshape(b, h // size, size * length, d)


def _to_sequence(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[B, H/N, N*L, D] by heads -> [B, H, L, D] by sequence (the inverse of `_to_heads`)."""
    b, local_heads, full, d = x.shape
    length = full // size
    sent = x.reshape(b, local_heads, size, length, d).permute(2, 1, 0, 3, 4).contiguous()  # [N, H/N, B, L, D]
    got = all_to_all_single(sent.reshape(size * local_heads, b, length, d), group)
    return got.reshape(size * local_heads, b, length, d).permute(1, 0, 2, 3)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, scale: float) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence by all-to-all: `q` [B, H, L, D], `k`, `v`
    [B, Hkv, L, D] of this rank's zig-zag parts; `layout` (a `ContextMask`) gives the whole sequence's mask.
    Returns [B, L, H, D] in `q`'s dtype."""
    group, size = layout.group, layout.size
    check_heads(q.shape[1], k.shape[1], size)
    q_, k_, v_ = (_to_heads(x, group, size) for x in (q, k, v))
    repeat = q_.shape[1] // k_.shape[1]
    if repeat > 1:  # query head h uses key/value head h // repeat: the split keeps the groups together
        k_, v_ = k_.repeat_interleave(repeat, dim=1), v_.repeat_interleave(repeat, dim=1)
    out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=layout.sequence_mask(), scale=scale)
    return _to_sequence(out, group, size).transpose(1, 2).contiguous()
