"""Tensor parallelism for the planner: what one of `tp` ranks holds, computes and communicates (pure arithmetic).

A block's `TensorSplit` (plan/model.py) names the parts tp divides; the rest is replicated on the tp ranks.
Per rank at degree t:

- parameters (so gradients and AdamW state): split / t + replicated;
- activations kept for backward: split / t + replicated, everything / t with sequence parallelism;
- compute: the split FLOPs / t, the split memory traffic / t (all of it with sequence parallelism); kernel
  launches do not shrink. That is the only efficiency loss charged: no further penalty, because the rates
  the planner has are per device, and a smaller matrix's lower rate is what a measured `rate_by_samples`
  holds (a layer split t ways runs at the rate of the whole layer on samples / t, the same work per kernel);
- communication (Megatron's analysis, Narayanan et al. SC'21 section 3.3; Korthikanti et al. 2022 section
  4.2.2): `collectives` per forward pass and as many in backward, each of the (s, h) activation of the
  micro-batch: an all-reduce without sequence parallelism, an all-gather plus a reduce-scatter with it. A
  ring all-reduce of B bytes over t ranks costs 2(t-1)/t · B / bw + 2(t-1) · latency, an all-gather or a
  reduce-scatter half of that, so both variants cost the same time. Priced on the intra-node collective
  link (`Network.collective_*`: a TP group never leaves its node) and not overlapped with compute. Each call
  also pays `Network.tp_collective_s` per peer (t - 1 of them): the fixed cost of a DTensor collective beyond
  the bare ring, host dispatch and the wait for the slower rank, which a calibration measures
  (bench/calibrate_tp.py; 0 in the stated GPU nodes, whose NCCL latency already stands for it).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.plan.hardware import Network
from pipetrain.plan.model import BlockCost

__all__ = ["tp_problem", "tp_params", "tp_param_bytes", "tp_activation_bytes", "tp_output_bytes", "tp_flops",
           "tp_traffic", "allreduce_s", "tp_comm_s"]


def tp_problem(blocks: Sequence[BlockCost], tp: int, sequence_parallel: bool = False, cp: int = 1) -> str | None:
    """Why the model cannot run at `tp` (a sentence naming the size), or None when it can; under sequence
    parallelism beside `cp`, tp cuts each cp rank's part of the sequence."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return f"tp must be a positive integer, got {tp!r}"
    if tp == 1:
        return None
    splits = [b.tensor for b in blocks if b.tensor is not None]
    if not splits:
        return "the model has no tensor-parallel plan (no block splits its matrices)"
    for split in splits:
        for name, size in split.divides:
            if size % tp:
                return f"tp={tp} does not divide {name}={size}"
        if sequence_parallel and split.sequence % (tp * cp):
            held = (f"the {split.sequence // cp} tokens a cp rank holds of each sequence" if cp > 1
                    else f"the sequence length {split.sequence}")
            return f"tp={tp} does not divide {held} (sequence parallelism)"
    return None


def tp_params(block: BlockCost, tp: int) -> float:
    """Parameters one of `tp` ranks holds."""
    split = block.tensor.params if block.tensor is not None and tp > 1 else 0
    return block.params - split + split / tp


def tp_param_bytes(block: BlockCost, tp: int) -> float:
    """Parameter bytes one of `tp` ranks holds."""
    if block.tensor is None or tp == 1 or not block.params:
        return block.param_bytes
    return block.param_bytes * tp_params(block, tp) / block.params


def tp_activation_bytes(block: BlockCost, tp: int, sequence_parallel: bool = False) -> float:
    """Activation bytes per sample one of `tp` ranks keeps for backward."""
    split = block.tensor.activation_bytes if block.tensor is not None else 0.0
    return _per_rank(block.activation_bytes, split, tp if block.tensor is not None else 1, sequence_parallel)


def tp_output_bytes(block: BlockCost, tp: int, sequence_parallel: bool = False) -> float:
    """Bytes per sample a rank sends to the next stage: its sequence shard with sequence parallelism (each
    rank sends its plain local shard to its peer), else the whole (replicated) activation."""
    return block.output_bytes / tp if sequence_parallel and tp > 1 else block.output_bytes


def tp_flops(block: BlockCost, tp: int) -> float:
    """Forward FLOPs per sample one of `tp` ranks runs."""
    split = block.tensor.flops if block.tensor is not None and tp > 1 else 0.0
    return block.forward_flops - split + split / tp


def tp_traffic(block: BlockCost, tp: int, sequence_parallel: bool = False) -> float:
    """Forward memory traffic per sample one of `tp` ranks moves."""
    split = block.tensor.traffic if block.tensor is not None else 0.0
    return _per_rank(block.forward_traffic, split, tp if block.tensor is not None else 1, sequence_parallel)


def _per_rank(total: float, split: float, tp: int, sequence_parallel: bool) -> float:
    """One of `tp` ranks' share of `total`, of which `split` is divided by TP (all of it with sequence
    parallelism); tp 1: the whole."""
    if tp <= 1:
        return total
    return total / tp if sequence_parallel else total - split + split / tp


def allreduce_s(nbytes: float, ranks: int, network: Network) -> float:
    """A ring all-reduce of `nbytes` over `ranks` on the intra-node collective link (also the time of an
    all-gather followed by a reduce-scatter of the same tensor)."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / network.collective_bytes_per_s + 2 * (ranks - 1) * network.collective_latency_s


def tp_comm_s(block: BlockCost, samples: int, tp: int, network: Network) -> float:
    """Seconds of tensor-parallel collectives in one forward (and as many in one backward) of a micro-batch:
    per collective the ring's time plus the fixed per-peer cost of a DTensor collective."""
    if block.tensor is None or tp == 1:
        return 0.0
    per_call = allreduce_s(samples * block.tensor.comm_bytes, tp, network) + (tp - 1) * network.tp_collective_s
    return block.tensor.collectives * per_call
