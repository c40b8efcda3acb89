"""The search's lower bound on a layout's step time: what branch and bound orders and prunes the layouts by.

A rank runs its actions one at a time, so the simulated span is never shorter than the average rank's compute
(with its recomputation and tensor-parallel collectives), its gradient reduction and its optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.context import context_samples
from pipetrain.plan.experts import expert_layout, rank_parts
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.layout import Layout
from pipetrain.plan.model import BlockCost
from pipetrain.plan.tensor import tp_comm_s, tp_param_bytes
from pipetrain.plan.times import SELECTIVE_RECOMPUTE_SHARE, block_times, optimizer_s, reduce_s

__all__ = ["lower_bound_s"]


def lower_bound_s(blocks: Sequence[BlockCost], layout: Layout, device: Device, network: Network,
                  cache: dict | None = None) -> float:
    """A step time the simulation cannot beat: the average rank's compute, gradient reduction and optimizer.
    `cache`: a dict kept across calls on the same blocks, device and network (the model's sums per size)."""
    samples = context_samples(layout.batch // layout.dp // layout.chunks, layout.cp)
    tp, sp = layout.tp, layout.sequence_parallel
    key = (samples, tp, sp, layout.ep)
    parts = ("parts", layout.ep)
    dense, shares = cache[parts] if cache is not None and parts in cache else rank_parts(blocks, layout.ep)
    if cache is not None:
        cache[parts] = dense, shares
    if cache is None or key not in cache:
        times = [block_times(b, samples, device, tp, sp) for b in blocks]
        comm = sum(tp_comm_s(b, samples, tp, network) for b in blocks)
        sums = (sum(t[0] for t in times), sum(sum(t) for t in times), comm,
                sum(tp_param_bytes(b, tp) for b in dense), sum(b.param_bytes for b in shares))
        if cache is not None:
            cache[key] = sums
    else:
        sums = cache[key]
    forward, total, comm, param_bytes, expert_bytes = sums
    work = total + 2 * comm
    if layout.checkpoint != "never":
        again = layout.chunks if layout.checkpoint == "always" else layout.chunks - 1
        redo = SELECTIVE_RECOMPUTE_SHARE * forward if layout.recompute_unit == "selective" else forward
        work += again / layout.chunks * (redo + comm) / (layout.recompute_every if layout.recompute_unit != "stage"
                                                         else 1)
    actions = 2 * layout.virtual * layout.chunks * device.action_overhead_s + device.step_overhead_s
    grads = layout.gradient_layout()
    shards = grads.shards
    experts = expert_layout(grads)
    expert_shards = experts.shards  # fsdp: dp / ep; hsdp: dp_shard / ep; ddp: 1
    if cache is None or (shards, tp, layout.ep) not in cache:
        optimizer = optimizer_s(dense, device, shards, tp) + (optimizer_s(shares, device, expert_shards)
                                                               if shares else 0.0)
        if cache is not None:
            cache[shards, tp, layout.ep] = optimizer
    else:
        optimizer = cache[shards, tp, layout.ep]
    reduce = reduce_s(param_bytes, grads, network) + (reduce_s(expert_bytes, experts, network) if shares else 0.0)
    return (layout.chunks * work + reduce + optimizer) / layout.pp + actions
