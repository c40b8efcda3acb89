"""Ring attention: exact attention over a sequence whose zig-zag parts lie on the N ranks of a context-parallel group.

Each rank keeps its queries and passes its keys and values around the ring (point-to-point, one step per rank);
at each step it attends its two query parts to the two key/value parts it holds, and the partial results are
combined exactly through their log-sum-exp. Blocks that the mask hides wholly (a key part after a query part, or
parts with no document in common) are skipped; a step whose blocks are all skipped still exchanges (its peers wait).

The whole ring is one autograd function (ring-flash-attention's algorithm): the forward keeps only this rank's q, k,
v and the merged output and log-sum-exp; the backward runs the ring again, each block's kernel backward taking the
global output and log-sum-exp (so each block's gradient is exactly its share, with no gradient through the merge),
and the key/value gradients of a block travel round the ring with it, each rank adding its share, back to the rank
that owns the block. The block attention is `blocks.block_kernel`'s: torch's fused kernel by default, torch ops
where it cannot run. The exchanges run inside the function's forward and backward, in one fixed order on every rank,
so torch.utils.checkpoint (non-reentrant) and the pipeline's recomputation run the ring again as they run any op.

The exchange overlaps the block attention (`exchange="overlap"`, the default): each step posts the next key/value
block's send and receive before attending to the block it holds, and waits for them after; in the backward the
accumulated key/value gradients are posted after a step's blocks and waited for after the next step's. `"sync"`
sends and waits at once (no overlap); `"local"` replaces the exchange by a local copy of the same shape (wrong
attention: a measurement of the step without communication only). Each wait is a "cp_ring" span of a traced step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.context.blocks import BlockKernel, Mask, block_kernel, merge_
from pipetrain.pipeline.timeline import span

__all__ = ["EXCHANGES", "ring_attention"]

#: how the ring passes its key/value blocks: overlapped with the attention, synchronous, or not at all
#: (a local copy: measurement only)
EXCHANGES = ("overlap", "sync", "local")


def _peers(group: dist.ProcessGroup) -> tuple[int, int]:
    """The global ranks this rank sends to (the next of the ring) and receives from (the previous)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


class _InFlight:
    """One ring step's exchange in flight: the peers, the requests posted and the buffers they use (kept alive
    until waited for)."""

    def __init__(self, group: dist.ProcessGroup, send_to: int, recv_from: int) -> None:
        self.group, self.send_to, self.recv_from = group, send_to, recv_from
        self.requests: list[Any] = []
        self.received: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None

    def post(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send `tensor` to the next rank and post the receive from the previous one; returns the receive buffer,
        filled once `wait` returns."""
        self._sent = tensor.contiguous()  # first: empty_like keeps a permuted tensor's strides
        self.received = torch.empty_like(self._sent)
        ops = [dist.P2POp(dist.isend, self._sent, self.send_to, self.group),
               dist.P2POp(dist.irecv, self.received, self.recv_from, self.group)]
        self.requests = dist.batch_isend_irecv(ops)
        return self.received

    def wait(self) -> torch.Tensor:
        """Wait for the posted send and receive (a "cp_ring" span of a traced step); the received tensor."""
        with span("cp_ring"):
            for request in self.requests:
                request.wait()
        received, self.requests, self.received, self._sent = self.received, [], None, None
        assert received is not None
        return received


def _start(tensor: torch.Tensor, layout: Any) -> Callable[[], torch.Tensor]:
    """Start passing `tensor` to the next rank of the ring (`layout.exchange`'s way); a function that returns the
    previous rank's (a ring of one rank: `tensor` itself)."""
    if layout.size == 1:
        return lambda: tensor
    if layout.exchange == "local":
        copy = tensor.clone()  # measurement only: the step's compute without its communication
        return lambda: copy
    flight = _InFlight(layout.group, *_peers(layout.group))
    flight.post(tensor)
    if layout.exchange == "sync":
        received = flight.wait()
        return lambda: received
    return flight.wait


def _visible(layout: Any, source: int, half: int) -> Iterator[tuple[slice, slice, Mask]]:
    """This rank's query part and rank `source`'s key part of each block the mask does not wholly hide, with the
    block's mask (None: all visible)."""
    parts = (slice(0, half), slice(half, 2 * half))
    for a in (0, 1):
        for b in (0, 1):
            mask = layout.block_mask(source, a, b)
            if mask is not False:
                yield parts[a], parts[b], None if mask is True else mask


class _Ring(torch.autograd.Function):
    """The ring's attention of this rank's queries over every rank's keys and values, forward and backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, scale: float,
                kernel: BlockKernel) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the inputs' dtype, autocast or not
            out, lse = _forward(q, k, v, layout, scale, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.kernel = layout, scale, kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            grad_q, grad_k, grad_v = _backward(grad, q, k, v, out, lse, ctx.layout, ctx.scale, ctx.kernel)
        return grad_q, grad_k, grad_v, None, None, None


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, scale: float,
             kernel: BlockKernel) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output [B, H, L, D] and log-sum-exp [B, H, L] (fp32) of this rank's queries over the ring."""
    half = q.shape[2] // 2
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    held = torch.stack([k, v])
    for step in range(layout.size):
        source = (layout.rank - step) % layout.size
        incoming = _start(held, layout) if step + 1 < layout.size else None  # posted before the attention
        for qs, ks, mask in _visible(layout, source, half):
            block = kernel.forward(q[:, :, qs], held[0][:, :, ks], held[1][:, :, ks], mask, scale)
            merge_(out[:, :, qs], lse[:, :, qs], *block)
        if incoming is not None:
            held = incoming()
    return out, lse


def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, layout: Any, scale: float,
              kernel: BlockKernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v: the ring run again, each block's key/value gradients accumulated as they pass
    from rank to rank and arriving, after the last step, at the rank that owns the block."""
    half = q.shape[2] // 2
    grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    held = torch.stack([k, v])
    passed: Callable[[], torch.Tensor] | None = None  # the gradient of the held block from the ranks before
    for step in range(layout.size):
        source = (layout.rank - step) % layout.size
        incoming = _start(held, layout) if step + 1 < layout.size else None
        grad_kv = torch.zeros(held.shape, dtype=torch.float32, device=q.device)
        for qs, ks, mask in _visible(layout, source, half):
            gq, gk, gv = kernel.backward(grad[:, :, qs], q[:, :, qs], held[0][:, :, ks], held[1][:, :, ks],
                                         out[:, :, qs], lse[:, :, qs], mask, scale)
            grad_q[:, :, qs] += gq
            grad_kv[0][:, :, ks] += gk
            grad_kv[1][:, :, ks] += gv
        if passed is not None:
            grad_kv += passed()
        passed = _start(grad_kv, layout)  # to the next rank, which holds this block at the next step
        if incoming is not None:
            held = incoming()
    assert passed is not None
    grad_kv = passed()
    return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, scale: float) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence: `q` [B, H, L, D], `k`, `v` [B, Hkv, L, D] (GQA:
    H a multiple of Hkv) of this rank's two zig-zag parts; `layout` (a `ContextMask`) gives each part pair's mask,
    the exchange and the block kernel. Returns [B, L, H, D] in `q`'s dtype, as transformers' attention functions do."""
    out = _Ring.apply(q, k, v, layout, scale, block_kernel(layout.kernel, q))
    return out.transpose(1, 2).contiguous()
