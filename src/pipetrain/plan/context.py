"""Context parallelism in the planner: a sequence split over `cp` ranks of a stage, ring or all-to-all attention.

Every per-token cost of a block divides by cp (each rank holds s / cp tokens of each sequence; zig-zag parts give
each rank an equal share of the causal attention too), so a micro-batch of b sequences costs a rank what b / cp
sequences cost without it (`context_samples`); parameters are whole on every CP rank and their gradients are
reduced over the dp · cp ranks that hold them (`context_replicas`). What CP adds is each attention layer's exchange
(`context_comm_s`), per forward and twice per backward (the gradients of what was exchanged go back):

- ring (`cp_attention="ring"`): each rank passes its key/value part around the ring, cp − 1 steps, each overlapped
  with the attention over the part it holds: the exposed time is what the sends take beyond that attention, plus
  a latency per step;
- all-to-all (`"ulysses"`): q, k, v from sequence-split to head-split and the output back, four all-to-alls that
  wait for nothing to overlap them; heads (and key/value heads) must divide by cp (`cp_problem`).

A block's `ContextSplit` holds, per sequence, the key/value bytes, the query and output bytes, the attention's
score FLOPs and its head counts. CP ranks sit inside a stage, next to the tensor-parallel ones (tp innermost):
a CP group stays in a node when cp · tp ranks fit in one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pipetrain.config import CP_ATTENTIONS
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import BlockCost

__all__ = ["CP_ATTENTIONS", "cp_problem", "context_degrees", "context_samples", "context_replicas", "context_comm_s"]



class _Layout(Protocol):
    cp: int
    cp_attention: str
    tp: int
    dp: int
    gpus_per_node: int


def cp_problem(blocks: Sequence[BlockCost], cp: int, attention: str = "ring") -> str | None:
    """Why `cp` cannot split the sequences of `blocks` with `attention`, or None."""
    if not isinstance(cp, int) or cp < 1:
        return f"cp must be a positive integer, got {cp!r}"
    if attention not in CP_ATTENTIONS:
        return f"unknown context-parallel attention {attention!r} (one of {', '.join(CP_ATTENTIONS)})"
    if cp == 1:
        return None
    attended = [b for b in blocks if b.context is not None]
    if not attended:
        return f"cp={cp} splits the attention over the sequence, and no block of the model has one it can split"
    for block in attended:
        split = block.context
        if split.sequence % (2 * cp if attention == "ring" else cp):
            need = 2 * cp if attention == "ring" else cp
            return f"cp={cp} does not split the sequence length {split.sequence} into {need} equal parts"
        if attention == "ulysses" and (split.heads % cp or split.kv_heads % cp):
            return (f"cp={cp} does not divide the {split.heads} heads and {split.kv_heads} key/value heads of "
                    f"{block.name} (all-to-all attention gives each rank whole heads)")
    return None


def context_degrees(blocks: Sequence[BlockCost], most: int, attention: str = "ring") -> tuple[int, ...]:
    """The context-parallel degrees worth searching: every power of 2 up to `most` that splits the sequences of
    `blocks` with `attention` ((1,) when no block has an attention it can split)."""
    return tuple(cp for cp in (1 << k for k in range(0, 16)) if cp <= most and cp_problem(blocks, cp, attention) is None)


def context_samples(samples: float, cp: int) -> float:
    """The sequences whose whole cost equals one CP rank's share of `samples` sequences."""
    return samples / cp


def context_replicas(layout: _Layout) -> int:
    """The ranks a stage's gradients are reduced over: its dp replicas times its cp ranks."""
    return layout.dp * layout.cp


def _link(layout: _Layout, network: Network) -> tuple[float, float, float, float]:
    """(point-to-point latency, bandwidth, collective latency, bandwidth) of a CP group's ranks."""
    inside = layout.gpus_per_node <= 0 or layout.cp * layout.tp <= layout.gpus_per_node
    if inside:
        return (network.p2p_latency_s, network.p2p_bytes_per_s, network.collective_latency_s,
                network.collective_bytes_per_s)
    latency, bandwidth = network.across_collective()
    return network.inter_latency_s, network.inter_bytes_per_s, latency, bandwidth


def context_comm_s(block: BlockCost, samples: float, layout: _Layout, network: Network,
                   device: Device) -> tuple[float, float]:
    """(forward, backward) seconds of `block`'s context-parallel exchange on one rank for a micro-batch of
    `samples` sequences (0 without CP or attention); one of `layout.tp` ranks moves its share of the heads."""
    cp, split = layout.cp, block.context
    if cp == 1 or split is None:
        return 0.0, 0.0
    p2p_latency, p2p_bandwidth, latency, bandwidth = _link(layout, network)
    part = samples / cp / layout.tp  # this rank's share of the sequence and of the heads
    if layout.cp_attention == "ulysses":
        moved = part * (split.kv_bytes + split.qo_bytes) * (cp - 1) / cp
        forward = moved / bandwidth + 4 * (cp - 1) * latency
        return forward, 2 * forward
    send = part * split.kv_bytes / p2p_bandwidth + p2p_latency  # one step of the ring
    attend = part * split.flops / cp / device.flops_per_s  # the attention over one part, meanwhile
    forward = (cp - 1) * max(0.0, send - attend) + (cp - 1) * p2p_latency
    return forward, 2 * forward
