"""Ring attention: exact attention over a sequence whose zig-zag parts lie on the N ranks of a context-parallel group.

Each rank keeps its queries and passes its keys and values around the ring (point-to-point, one step per rank);
at each step it attends its two query parts to the two key/value parts it holds, and the partial results are
combined exactly through their log-sum-exp. Blocks that the mask hides wholly (a key part after a query part, or
parts with no document in common) are skipped; a step whose blocks are all skipped still passes a zero gradient back,
since the peers of the ring wait for every exchange's backward. The block attention is an autograd function that keeps only q, k, v, its
output and log-sum-exp, and recomputes the scores in its backward (with the log-sum-exp's own gradient, which the
merge needs); the ring's exchange is an autograd function whose backward sends the gradients the other way round,
so forward and backward are exact, recomputation included.

The exchange overlaps the block attention (`exchange="overlap"`, the default): each step posts the next key/value
block's send and receive (asynchronous) before attending to the block it holds, and waits for them after; in the
backward the gradients of the blocks travel back the same way, posted when a block's gradient is complete and waited
for after the autograd engine has run the previous step's block attention. `exchange="sync"` sends and waits before
each step (no overlap); `exchange="local"` replaces the exchange by a local copy of the same shape (wrong attention:
a measurement of the step without communication only). (torch 2.13's CPU flash kernel,
`aten._scaled_dot_product_flash_attention_for_cpu`, returns the log-sum-exp without a gradient: a merge through it
would drop that term of the backward, so it is not used here.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.pipeline.timeline import span

__all__ = ["EXCHANGES", "ring_attention", "ring_exchange", "block_attention", "merge"]

#: how the ring passes its key/value blocks: overlapped with the attention, synchronous, or not at all
#: (a local copy: measurement only)
EXCHANGES = ("overlap", "sync", "local")

#: the score of a masked pair: exp() of it against any real score is 0, and a wholly masked row stays finite
_MASKED = -1e30


class _Exchange(torch.autograd.Function):
    """Send a tensor to the next rank of the ring and receive the previous rank's; backward: the other way."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, send_to: int, recv_from: int) -> torch.Tensor:
        ctx.group, ctx.send_to, ctx.recv_from = group, send_to, recv_from
        return _send_recv(tensor, group, send_to, recv_from)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _send_recv(grad.contiguous(), ctx.group, ctx.recv_from, ctx.send_to), None, None, None


def _send_recv(tensor: torch.Tensor, group: dist.ProcessGroup, send_to: int, recv_from: int) -> torch.Tensor:
    """One ring step's exchange, a "cp_ring" span of a traced step (forward: keys and values; backward: their
    gradients)."""
    tensor = tensor.contiguous()  # first: empty_like keeps a permuted tensor's strides
    received = torch.empty_like(tensor)
    with span("cp_ring"):
        ops = [dist.P2POp(dist.isend, tensor, send_to, group),
               dist.P2POp(dist.irecv, received, recv_from, group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return received


def _peers(group: dist.ProcessGroup) -> tuple[int, int]:
    """The global ranks this rank sends to (the next of the ring) and receives from (the previous)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)


def ring_exchange(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The previous rank's `tensor` (this rank's goes to the next one); differentiable."""
    return _Exchange.apply(tensor, group, *_peers(group))


class _InFlight:
    """One ring step's exchange in flight: the peers, the requests posted and the buffers they use (kept alive
    until waited for)."""

    def __init__(self, group: dist.ProcessGroup, send_to: int, recv_from: int) -> None:
        self.group, self.send_to, self.recv_from = group, send_to, recv_from
        self.requests: list[Any] = []
        self.received: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None

    def post(self, tensor: torch.Tensor, backward: bool = False) -> torch.Tensor:
        """Send `tensor` (the gradient: the other way round when `backward`) and post the receive; returns the
        receive buffer, filled once `wait` returns."""
        send_to, recv_from = (self.recv_from, self.send_to) if backward else (self.send_to, self.recv_from)
        self._sent = tensor.contiguous()
        self.received = torch.empty_like(self._sent)
        ops = [dist.P2POp(dist.isend, self._sent, send_to, self.group),
               dist.P2POp(dist.irecv, self.received, recv_from, self.group)]
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


class _Post(torch.autograd.Function):
    """Post the send of `tensor` to the next rank and the receive from the previous one, without waiting; the
    receive buffer (`_Wait` gives it once filled). Backward: wait for the gradient `_Wait`'s backward posted."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.post(tensor)

    @staticmethod
    def backward(ctx: Any, _posted: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.flight.wait(), None


class _Wait(torch.autograd.Function):
    """Wait for the exchange `_Post` posted; `received` filled. Backward: post the gradient's way back (to the rank
    the block came from) without waiting; `_Post`'s backward waits, after the attention of the step before."""

    @staticmethod
    def forward(ctx: Any, received: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        ctx.flight = flight
        return flight.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.flight.post(grad, backward=True)
        return grad, None  # a placeholder: `_Post`'s backward returns the received gradient


def _next_block(held: torch.Tensor, group: dist.ProcessGroup, exchange: str) -> Callable[[], torch.Tensor]:
    """Start passing `held` round the ring; a function that returns the previous rank's block (differentiable)."""
    if exchange == "sync":
        received = ring_exchange(held, group)
        return lambda: received
    if exchange == "local":
        copy = held.clone()  # measurement only: the step's compute without its communication
        return lambda: copy
    flight = _InFlight(group, *_peers(group))
    posted = _Post.apply(held, flight)
    return lambda: _Wait.apply(posted, flight)


class _BlockAttention(torch.autograd.Function):
    """Softmax attention of one query part over one key/value part, returning its output and log-sum-exp; the
    backward recomputes the scores (FlashAttention's way) and takes the log-sum-exp's gradient too, so that only
    q, k, v, the output and the log-sum-exp are kept between forward and backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, enabled=False):  # fp32 whatever the inputs' dtype, autocast or not
            scores = _scores(q, k, mask, scale)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            out = torch.matmul(torch.exp(scores - lse), v.float())
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.scale = scale
        return out, lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, mask = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return _BlockAttention._grads(q, k, v, out, lse, mask, ctx.scale, grad_out, grad_lse)

    @staticmethod
    def _grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               mask: torch.Tensor | None, scale: float, grad_out: torch.Tensor,
               grad_lse: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_out, grad_lse = grad_out.float(), grad_lse.float()
        probs = torch.exp(_scores(q, k, mask, scale) - lse)
        grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)
        grad_probs = torch.matmul(grad_out, v.float().transpose(-1, -2))
        # d out / d scores: P * (dP - rowsum(dO * O)); d lse / d scores: P
        grad_scores = probs * (grad_probs - (grad_out * out).sum(dim=-1, keepdim=True) + grad_lse) * scale
        grad_q = torch.matmul(grad_scores, k.float())
        grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.float())
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, _MASKED)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q` [B, H, Lq, D] over `k`, `v` [B, H, Lk, D] (`mask` [B, 1, Lq, Lk], True = attend):
    the output (fp32) and each query's log-sum-exp of scores [B, H, Lq, 1]; differentiable in both."""
    return _BlockAttention.apply(q, k, v, mask, scale)


def merge(acc: tuple[torch.Tensor, torch.Tensor] | None,
          block: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, combined exactly by their log-sum-exps."""
    if acc is None:
        return block
    (out, lse), (block_out, block_lse) = acc, block
    total = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - total) + block_out * torch.exp(block_lse - total), total


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, scale: float) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence: `q` [B, H, L, D], `k`, `v` [B, Hkv, L, D] (GQA:
    H a multiple of Hkv) of this rank's two zig-zag parts; `layout` (a `ContextMask`) gives each part pair's mask.
    Returns [B, L, H, D] in `q`'s dtype, as transformers' attention functions do."""
    group, rank, size = layout.group, layout.rank, layout.size
    repeat = q.shape[1] // k.shape[1]
    half = q.shape[2] // 2
    queries = (q[:, :, :half], q[:, :, half:])
    held = torch.stack([k, v])
    acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
    unused: list[torch.Tensor] = []
    exchange = layout.exchange
    for step in range(size):
        source = (rank - step) % size
        incoming = _next_block(held, group, exchange) if step + 1 < size else None  # posted before the attention
        keys, values = (held[0], held[1]) if repeat == 1 else (held[0].repeat_interleave(repeat, dim=1),
                                                               held[1].repeat_interleave(repeat, dim=1))
        used = False
        for a in (0, 1):
            for b in (0, 1):
                mask = layout.block_mask(source, a, b)
                if mask is False:
                    continue  # wholly masked: skipped
                used = True
                part = slice(b * half, (b + 1) * half)
                acc[a] = merge(acc[a], block_attention(queries[a], keys[:, :, part], values[:, :, part],
                                                       None if mask is True else mask, scale))
        if not used and held.requires_grad:
            unused.append(held)
        if incoming is not None:
            held = incoming()
    out = torch.cat([acc[0][0], acc[1][0]], dim=2)
    for tensor in unused:  # every rank must run every exchange's backward (its peers wait for it): a zero gradient
        out = out + 0.0 * tensor.sum()
    return out.to(q.dtype).transpose(1, 2).contiguous()
