"""Mixture-of-experts layers in the planner: what expert parallelism (`ep`) divides, moves and costs (pure).

A block's routed experts (`model.ExpertSplit`) are held by `ep` ranks of its stage's data-parallel group, E / ep
each (tensor parallelism does not split them); everything else of the block is held as without experts. So a rank
holds the block's dense part (`dense_part`: attention, norms, router, shared experts) plus its share of the experts
(`expert_share`), whose gradients are reduced over the dp / ep ranks that hold the same experts only, and whose
FSDP shards are cut over those ranks (`expert_layout`; under HSDP the EP group lies in one shard group, so the
experts shard over dp_shard / ep ranks and are replicated across the dp / dp_shard groups, as torchtitan's
"efsdp"). Per forward, each MoE block sends every token's hidden state to its top-k experts and back (two
all-to-alls: dispatch and combine, `(ep - 1) / ep` of the bytes leave the rank, after a third of the counts per
expert), as much again in backward (the counts have no gradient); each call also pays a fixed cost per peer that
the calibration measures (`Network.ep_all_to_all_s`: on gloo, far above the ring's latency); the
busiest expert works `imbalance` times the mean (1.0: a perfectly balanced router), which stretches the experts'
share of the compute. The EP group spans ep consecutive data-parallel replicas of a
stage (pipetrain's mesh puts dp outermost): within a node when ep · pp · tp ranks fit in one, else across nodes.
Beside context parallelism (`cp`) each cp rank routes its share of a sequence's tokens (the caller's `samples` are
that share) over the ep ranks of its cp coordinate, ep · cp · pp · tp ranks wide; the experts' gradients are reduced
over dp · cp / ep ranks (the caller's gradient layout counts the cp ranks in dp). As train, ep beside cp is priced
at pp 1 and tp 1 only (`ep_cp_problem`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import BlockCost

__all__ = ["ep_problem", "ep_cp_problem", "expert_degrees", "dense_part", "expert_share", "rank_parts",
           "expert_layout", "ep_extra_s", "ep_exchange_s", "moe_blocks"]


class _Layout(Protocol):
    dp: int
    pp: int
    tp: int
    ep: int
    cp: int
    gpus_per_node: int
    sequence_parallel: bool
    moe_imbalance: float
    dp_mode: str


def moe_blocks(blocks: Sequence[BlockCost]) -> list[BlockCost]:
    """The blocks that hold routed experts."""
    return [b for b in blocks if b.experts is not None]


def ep_problem(blocks: Sequence[BlockCost], ep: int, dp: int | None = None,
               dp_shard: int | None = None) -> str | None:
    """Why `ep` cannot split `blocks` (over `dp` replicas, and under HSDP shard groups of `dp_shard`, when given),
    or None."""
    if not isinstance(ep, int) or ep < 1:
        return f"ep must be a positive integer, got {ep!r}"
    if ep == 1:
        return None
    moe = moe_blocks(blocks)
    if not moe:
        return f"ep={ep} splits experts, and the model has none (a dense model)"
    for block in moe:
        if block.experts.experts % ep:
            return f"ep={ep} does not divide the {block.experts.experts} experts of {block.name}"
    if dp is not None and dp % ep:
        return f"ep={ep} does not divide dp={dp} (expert parallelism borrows ranks of a stage's data-parallel group)"
    if dp_shard and dp_shard % ep:
        return f"ep={ep} does not divide the HSDP shard group dp_shard={dp_shard} (an EP group lies in one)"
    return None


def ep_cp_problem(layout: _Layout) -> str | None:
    """Why `layout`'s ep cannot run beside its cp (train builds ep x cp at pp 1 and tp 1, not under HSDP), or None."""
    if layout.ep > 1 and layout.cp > 1 and (layout.pp > 1 or layout.tp > 1):
        return (f"ep={layout.ep} beside cp={layout.cp} is built at pp 1 and tp 1 only, not pp={layout.pp} x "
                f"tp={layout.tp}")
    if layout.ep > 1 and layout.cp > 1 and layout.dp_mode == "hsdp":
        return f"ep={layout.ep} beside cp={layout.cp} is built under DDP and FSDP, not HSDP"
    return None


def expert_degrees(blocks: Sequence[BlockCost], most: int) -> tuple[int, ...]:
    """The expert-parallel degrees worth searching: every power of 2 up to `most` that divides every MoE block's
    experts ((1,) for a dense model)."""
    moe = moe_blocks(blocks)
    if not moe:
        return (1,)
    experts = min(b.experts.experts for b in moe)
    return tuple(e for e in (1 << k for k in range(0, 16))
                 if e <= min(experts, most) and all(b.experts.experts % e == 0 for b in moe))


def dense_part(block: BlockCost) -> BlockCost:
    """`block` without its routed experts (itself when it has none)."""
    if block.experts is None:
        return block
    experts = block.experts.params
    return replace(block, params=block.params - experts,
                   param_bytes=block.param_bytes * (block.params - experts) / block.params,
                   tensors=block.tensors - block.experts.tensors, experts=None,
                   frozen_params=max(0, block.frozen_params - experts))


def expert_share(block: BlockCost, ep: int) -> BlockCost | None:
    """The experts of `block` one of `ep` ranks holds, as a block of parameters only (None: no experts)."""
    if block.experts is None:
        return None
    params = block.experts.params / ep
    return BlockCost(name=f"{block.name} experts/{ep}", params=round(params),
                     param_bytes=block.param_bytes * params / block.params, activation_bytes=0.0,
                     output_bytes=0.0, tensors=block.experts.tensors)


def rank_parts(blocks: Sequence[BlockCost], ep: int) -> tuple[list[BlockCost], list[BlockCost]]:
    """(the dense parts of `blocks`, the expert shares one of `ep` ranks holds)."""
    shares = [expert_share(b, ep) for b in blocks]
    return [dense_part(b) for b in blocks], [s for s in shares if s is not None]


def expert_layout(layout):
    """The layout the expert shares are held in: replicated (or FSDP-sharded) over the dp / ep ranks that hold the
    same experts, not split by tensor parallelism; under HSDP sharded over dp_shard / ep of them."""
    shard = max(1, layout.dp_shard // layout.ep) if layout.dp_mode == "hsdp" and layout.dp_shard else layout.dp_shard
    return replace(layout, dp=max(1, layout.dp // layout.ep), tp=1, sequence_parallel=False, dp_shard=shard)


def _a2a_s(nbytes: float, ep: int, layout: _Layout, network: Network) -> float:
    """One all-to-all call in which a rank sends `nbytes` spread evenly over the `ep` ranks of its group: the ring's
    latency and bandwidth, and the call's fixed cost per peer (`Network.ep_all_to_all_s`, calibrated)."""
    if ep == 1 or nbytes <= 0:
        return 0.0
    span = ep * layout.cp * layout.pp * layout.tp  # an EP group's ranks are a replica (cp · pp · tp ranks) apart
    across = layout.gpus_per_node > 0 and span > layout.gpus_per_node
    latency, bandwidth = (network.across_collective() if across
                          else (network.collective_latency_s, network.collective_bytes_per_s))
    return nbytes * (ep - 1) / ep / bandwidth + (ep - 1) * (latency + network.ep_all_to_all_s)


def ep_exchange_s(block: BlockCost, samples: int, layout: _Layout, network: Network) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE block's all-to-alls on a micro-batch of `samples`: in forward the
    counts per expert (int64), the tokens and the outputs back (`moe.dispatch`), in backward the outputs' and the
    tokens' gradients ((0, 0) for a block without experts or at ep = 1)."""
    if block.experts is None:
        return 0.0, 0.0
    tokens = samples * block.experts.dispatch_bytes / (layout.tp if layout.sequence_parallel else 1)
    exchange = 2 * _a2a_s(tokens, layout.ep, layout, network)
    return exchange + _a2a_s(8.0 * block.experts.experts, layout.ep, layout, network), exchange


def ep_extra_s(block: BlockCost, samples: int, layout: _Layout, network: Network,
               device: Device) -> tuple[float, float]:
    """(forward, backward) seconds an MoE block adds on one rank beyond its dense compute: its all-to-alls
    (`ep_exchange_s`) and, at ep > 1, the busiest rank's excess work (`layout.moe_imbalance` - 1
    of the experts' compute; twice that in backward)."""
    if block.experts is None:
        return 0.0, 0.0
    forward, backward = ep_exchange_s(block, samples, layout, network)
    # at ep = 1 a rank runs every expert: how tokens spread over them does not change its work
    excess = 0.0 if layout.ep == 1 else \
        max(0.0, layout.moe_imbalance - 1.0) * samples * block.experts.flops / device.flops_per_s
    return forward + excess, backward + 2 * excess
