"""A layout's time terms: a block's compute, recomputation's share of it, the optimizer step, the gradient
reduction over dp and the speed of ranks sharing CPU cores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.layout import Layout
from pipetrain.plan.model import BlockCost
from pipetrain.plan.tensor import tp_flops, tp_params, tp_traffic

__all__ = ["SELECTIVE_RECOMPUTE_SHARE", "block_times", "optimizer_s", "rank_speeds", "reduce_s", "recomputed_share"]


def block_times(block: BlockCost, samples: int, device: Device, tp: int = 1,
                sequence_parallel: bool = False) -> tuple[float, float]:
    """(forward, backward) compute seconds of one block on a micro-batch of `samples` (on one of `tp` ranks:
    its share of the FLOPs and traffic; the TP collectives are `tensor.tp_comm_s`)."""
    flops = tp_flops(block, tp)
    if block.forward_flops and device.rate_by_samples:  # a measured whole-layer rate: overheads included
        # a layer split tp ways does the work per kernel of the whole layer on samples * flops / forward_flops
        per_sample, fixed = flops / device.flops_at(samples * flops / block.forward_flops), 0.0
    else:
        per_sample = flops / device.flops_per_s + tp_traffic(block, tp, sequence_parallel) / device.bytes_per_s
        fixed = block.kernels * device.kernel_overhead_s
    forward = fixed + block.fixed_forward_s + samples * (per_sample + block.forward_s)
    backward = (2 * fixed + block.fixed_backward_s + samples * (2 * per_sample + block.backward_s)
                + block.fixed_backward_traffic / device.bytes_per_s)
    return forward, backward


def optimizer_s(blocks: Sequence[BlockCost], device: Device, shards: int = 1, tp: int = 1) -> float:
    """AdamW's step over the parameters of `blocks` (a per-tensor loop; FSDP: `shards` slices of each; one of
    `tp` ranks: its share), plus DTensor's dispatch on every DTensor parameter: all of them under FSDP
    (`shards` > 1), the split blocks' under tensor parallelism."""
    params = sum(tp_params(b, tp) * b.trained_share for b in blocks) / shards  # frozen parameters: no step
    tensors = sum(b.tensors for b in blocks)
    if shards > 1:
        dtensors = tensors
    else:
        dtensors = sum(b.tensor.tensors for b in blocks if b.tensor is not None) if tp > 1 else 0
    return (params * device.optimizer_s_per_param + tensors * device.optimizer_s_per_tensor
            + dtensors * device.optimizer_s_per_dtensor)


def rank_speeds(device: Device, layout: Layout) -> tuple[float, ...]:
    """Entry n - 1: how fast each of n computing ranks of a pipeline runs when the ranks of a node share its
    `device.cores` CPU cores (the node's other ranks, dp replicas included, busy in the same proportion);
    () when every rank has its own device."""
    if not device.cores and not device.contention:
        return ()
    node = min(layout.gpus_per_node or layout.world_size, layout.world_size)
    speeds = []
    for n in range(1, layout.pp + 1):
        busy = max(node * n / layout.pp, 1.0)
        cores = min(busy, device.cores) if device.cores else busy
        speeds.append(cores / busy / (1.0 + device.contention * (cores - 1)))
    return tuple(speeds)


def reduce_s(param_bytes: float, layout: Layout, network: Network, groups: int = 0) -> float:
    """Ring all-reduce (DDP) or reduce-scatter + two all-gathers (FSDP) of one stage over dp replicas, once per
    micro-batch when FSDP reshards (`Layout.fsdp_reshard`); FSDP also pays `network.fsdp_group_s` for each of its
    `groups` (parameter groups: the stage's blocks and root) each time."""
    n = layout.dp
    if n == 1:
        return 0.0
    across = layout.gpus_per_node > 0 and layout.world_size > layout.gpus_per_node
    latency, bandwidth = (network.across_collective() if across
                          else (network.collective_latency_s, network.collective_bytes_per_s))
    sharded = layout.dp_mode in ("fsdp", "hsdp")
    if layout.dp_mode == "hsdp":  # FSDP within a shard group (a node), then an all-reduce of the shards across
        inner = replace(layout, dp_mode="fsdp", dp=layout.shards, gpus_per_node=0)
        replicas = n // layout.shards
        return (reduce_s(param_bytes, inner, network, groups) +
                (2.0 * (replicas - 1) / replicas * param_bytes / layout.shards / bandwidth + 2 * (replicas - 1)
                 * latency if replicas > 1 else 0.0))
    # FSDP resharding after forward: each micro-batch gathers the weights twice (forward, backward) and
    # reduce-scatters its gradients; else the weights are gathered and the gradients reduced once per step
    rounds = layout.chunks if sharded and layout.fsdp_reshard else 1
    volume = rounds * (3.0 if sharded else 2.0) * (n - 1) / n * param_bytes
    fixed = rounds * groups * network.fsdp_group_s if sharded else 0.0
    return volume / bandwidth + 2 * (n - 1) * latency + fixed


#: the share of a block's forward time selective recomputation runs again (its cheap ops: norms, activations,
#: elementwise; the matrix products and attention are kept): their share of a transformer layer's time at scale
SELECTIVE_RECOMPUTE_SHARE = 0.1


def recomputed_share(block: BlockCost, layout: Layout) -> float:
    """The share of `block`'s forward time its recomputation runs again: all of it (a whole block), the cheap ops
    (selective), and under "alternate" the FLOPs of the matrix products it did not keep."""
    if layout.recompute_unit != "selective":
        return 1.0
    extra = block.alternate_flops / block.forward_flops if layout.selective_matmuls == "alternate" and \
        block.forward_flops else 0.0
    return min(1.0, SELECTIVE_RECOMPUTE_SHARE + extra)
