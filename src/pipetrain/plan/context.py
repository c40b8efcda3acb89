"""Context parallelism in the planner: a sequence split over `cp` ranks of a stage, ring or all-to-all attention.

Every per-token cost of a block divides by cp (each rank holds s / cp tokens of each sequence; zig-zag parts give
each rank an equal share of the causal attention too), so a micro-batch of b sequences costs a rank what b / cp
sequences cost without it (`context_samples`); parameters are whole on every CP rank and their gradients are
reduced over the dp · cp ranks that hold them (`context_replicas`). Beside tp with sequence parallelism the same
b / cp sequences go through the tensor-parallel terms (`plan/tensor.py`): the norm regions' activations divide by tp
again (1 / (cp · tp) of each sequence) and SP's all-gathers and reduce-scatters move the cp part; tp must divide a
cp rank's s / cp tokens (`tensor.tp_problem`). What CP adds is each attention layer's exchange
(`context_comm_s`):

- ring (`cp_attention="ring"`, context/ring.py, `ring_messages`): the forward sends this rank's key/value part (the
  activations' dtype) to the next rank cp − 1 times; the backward runs the ring again, sending the key/value part
  cp − 1 times and the part's accumulated gradients (fp32) cp times, until they are back with their owner. Each
  send overlaps the attention (backward: twice its FLOPs) of the step it was posted in (a gradient: of the next
  step); the exposed time is what the sends take beyond that, plus a latency per message; the backward's last
  gradient send waits for nothing;
- all-to-all (`"ulysses"`): q, k, v from sequence-split to head-split and the output back, four all-to-alls that
  wait for nothing to overlap them, per forward and twice per backward; heads (and key/value heads) must divide by
  cp (`cp_problem`).

A block's `ContextSplit` holds, per sequence, the key/value bytes, the query and output bytes, the attention's
score FLOPs and its head counts. CP ranks are placed as train's mesh places them (parallel/mesh.py: rank =
((replica · cp + cp rank) · pp + pp rank) · tp + tp rank): a CP group's ranks are pp · tp apart, so it stays in a
node when cp · pp · tp ranks fit in one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pipetrain.config import CP_ATTENTIONS
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import BlockCost, ContextSplit

__all__ = ["CP_ATTENTIONS", "cp_problem", "context_degrees", "context_samples", "context_replicas", "context_comm_s",
           "ring_messages"]

#: bytes per element of the ring's key/value gradients (accumulated and sent in fp32 whatever the activations')
GRAD_ELEMENT = 4


class _Layout(Protocol):
    cp: int
    cp_attention: str
    pp: int
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
    inside = layout.gpus_per_node <= 0 or layout.cp * layout.pp * layout.tp <= layout.gpus_per_node
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
    attend = part * split.flops / cp / device.flops_per_s  # the attention over one part, meanwhile
    forward, backward = ring_messages(split, cp)
    forward_s = sum(_exposed([m], part, attend, p2p_latency, p2p_bandwidth) for m in forward)
    kv, grads = backward[0:-1:2], backward[1:-1:2] + backward[-1:]
    # step i's attention backward overlaps its key/value send and the gradients posted after step i - 1
    steps = [kv[i:i + 1] + (grads[i - 1:i] if i else []) for i in range(cp)]
    backward_s = sum(_exposed(step, part, 2 * attend, p2p_latency, p2p_bandwidth) for step in steps)
    return forward_s, backward_s + _exposed(grads[-1:], part, 0.0, p2p_latency, p2p_bandwidth)  # waited at once


def ring_messages(split: ContextSplit, cp: int) -> tuple[list[float], list[float]]:
    """The bytes of each message one rank of the ring sends per sequence, in order (forward, backward), with the
    whole heads (a tensor-parallel rank sends its share): the forward's cp − 1 key/value parts (k and v of its
    sequence / cp tokens, in the activations' dtype); the backward's key/value part and, after each step, the fp32
    gradients of the part it held: cp − 1 of each, then the last step's gradients."""
    part = split.kv_bytes / cp
    grads = part * GRAD_ELEMENT / split.element
    return [part] * (cp - 1), [part, grads] * (cp - 1) + [grads]


def _exposed(messages: list[float], samples: float, overlap_s: float, latency: float, bandwidth: float) -> float:
    """Seconds `messages` (bytes per sequence, `samples` sequences) sent together show beyond `overlap_s` of
    computation, plus a latency per message."""
    send = sum(samples * m / bandwidth + latency for m in messages)
    return max(0.0, send - overlap_s) + latency * len(messages)
