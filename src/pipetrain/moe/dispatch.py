"""Token dispatch and combine for expert parallelism: an all-to-all of uneven sizes there and back, differentiable.

A MoE layer's router gives each of a rank's N tokens its top-k experts. `dispatch` sends every (token, expert)
pair to the rank of the expert-parallel group that holds that expert (experts [r·E/ep, (r+1)·E/ep) on rank r):
first the counts per expert (an all-to-all of equal sizes), then the tokens (an all-to-all of the sizes those
counts give, which may be zero). The receiver gets its tokens grouped by local expert, ready for one grouped
matmul. `combine` sends the experts' outputs back the same way, puts them in the pairs' order and applies the
router's weights as transformers' experts do (each output times its weight, summed over the token's k experts).

The backward of each all-to-all is the all-to-all of the gradients with the sizes swapped (`AllToAll`); with an
expert-parallel group of one rank nothing is sent. Every rank of the group must call `dispatch` and `combine` the
same number of times in the same order (the pipeline's schedule does: each rank runs the same actions).

With `backward_group` (a second process group of the same ranks: `--moe-overlap on`), every exchange made during a
backward pass — the all-to-alls' gradients and a recomputed forward's exchanges — uses it, and the forward's use
`group`: a forward in one thread and a backward in another (DualPipeV's fused actions, `compat.overlap`) then
never interleave their collectives on one group, and each group sees the same order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipetrain.compat.overlap import in_backward

__all__ = ["AllToAll", "Dispatched", "all_to_all", "dispatch", "combine"]


class AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of rows with uneven splits; its backward sends the gradients back (splits swapped)
    over `backward_group`."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
                backward_group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, backward_group
        return _exchange(rows, send, recv, _lane(group, backward_group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None, None


def _lane(group: dist.ProcessGroup | None, backward_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group an exchange made now uses: `backward_group` inside a backward pass (when given), else `group`."""
    return backward_group if backward_group is not None and in_backward() else group


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None,
               backward_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Rows `send[i]` to rank i of `group`, `recv[i]` rows from it (concatenated by rank); differentiable (the
    gradients over `backward_group`, by default `group`)."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    return AllToAll.apply(rows, send, recv, group, group if backward_group is None else backward_group)


@dataclass(frozen=True)
class Dispatched:
    """The tokens a rank's local experts received, and what `combine` needs to send their outputs back.

    `tokens` [R, H] are grouped by local expert (expert-major; within an expert by source rank, then by the
    source's token order); `counts` [E/ep] (int64, on the tokens' device) and `counts_list` are the rows per
    local expert; `per_expert` [E] are the pairs this rank routed to each expert of the layer (its own tokens).
    """

    tokens: torch.Tensor
    counts: torch.Tensor
    counts_list: list[int]
    per_expert: torch.Tensor
    order: torch.Tensor  # the pairs sorted by expert: pair index of each sent row
    regroup: torch.Tensor  # received (source-major) row of each expert-major row
    send: list[int]
    recv: list[int]
    group: dist.ProcessGroup | None
    top_k: int
    backward_group: dist.ProcessGroup | None = None


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    """Exclusive running sum: where each block of `sizes` starts."""
    return torch.cumsum(sizes, 0) - sizes


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int,
             group: dist.ProcessGroup | None, backward_group: dist.ProcessGroup | None = None) -> Dispatched:
    """Send each of the N tokens of `hidden` [N, H] to the ranks of `group` holding its experts `top_k_index`
    [N, k] (of `num_experts`, split evenly over the group's ranks in order); one host sync (the split sizes).
    `backward_group`: the same ranks' group for exchanges made inside a backward pass (see the module's text)."""
    ep = _group_size(group)
    local = num_experts // ep
    top_k = top_k_index.shape[-1]
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)
    rows = hidden[order // top_k]
    per_expert = torch.bincount(experts, minlength=num_experts)
    if ep == 1:
        received = per_expert.view(1, local)
    else:
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=_lane(group, backward_group))
        received = received.view(ep, local)  # [source rank, local expert]
    sizes = torch.cat([per_expert.view(ep, local).sum(1), received.sum(1), received.sum(0)]).tolist()
    send, recv, counts_list = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
    tokens = all_to_all(rows, send, recv, group, backward_group)
    # received rows are [source][local expert] blocks; list them expert-major: block (j, s) starts at start[s, j]
    by_expert = received.t().reshape(-1)
    first = _starts(received.reshape(-1)).view(ep, local).t().reshape(-1)
    total = tokens.shape[0]
    within = torch.arange(total, device=tokens.device) - torch.repeat_interleave(_starts(by_expert), by_expert,
                                                                                 output_size=total)
    regroup = torch.repeat_interleave(first, by_expert, output_size=total) + within
    return Dispatched(tokens=tokens[regroup], counts=received.sum(0), counts_list=counts_list, per_expert=per_expert,
                      order=order, regroup=regroup, send=send, recv=recv, group=group, top_k=top_k,
                      backward_group=backward_group)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def combine(outputs: torch.Tensor, dispatched: Dispatched, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' `outputs` [R, H] (rows as `dispatched.tokens`) back on their tokens' ranks: [N, H], each
    token's k outputs times its router weights `top_k_weights` [N, k], summed (in the outputs' dtype, as
    transformers' experts accumulate)."""
    d = dispatched
    rows = all_to_all(outputs[_inverse(d.regroup)], d.recv, d.send, d.group, d.backward_group)
    pairs = rows[_inverse(d.order)]
    weighted = (pairs * top_k_weights.reshape(-1, 1)).to(outputs.dtype)
    return weighted.view(-1, d.top_k, outputs.shape[-1]).sum(1)
