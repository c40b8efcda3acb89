"""Expert load after each step: the load imbalance per MoE layer, and the bias balancing of auxiliary-loss-free
routers (DeepSeek-V3's `e_score_correction_bias`).

Each MoE layer block counts the tokens its router sent to each expert in the step's training forwards (never in a
recomputed forward, `pipetrain.pipeline.recompute.is_recomputing`): a module with a `tokens_per_expert` tensor
(reset here) and, where the router balances by a bias, `balancing_bias()` returning that buffer. After the
optimizer step, `ExpertBalancer.after_step` sums the counts over the data-parallel ranks (and their cp ranks,
each of which counted its part of the sequences; every replica holds the
same layers; one all-reduce for all of this rank's layers) and moves each bias by the rule of the DeepSeek-V3
paper: `bias_e += rate * sign(mean load - load_e)` (an overloaded expert becomes less attractive), identically
on every replica. The load imbalance of a layer is max / mean tokens per expert (1 is perfect balance). With an
expert capacity (`pipetrain.moe.capacity`), the blocks also count the token-slots it dropped (`dropped_slots`),
summed in the same all-reduce: `dropped` holds each layer's (dropped, routed) slots of the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertBalancer", "routed_blocks", "DEFAULT_BIAS_RATE"]

#: the bias update rate (DeepSeek-V3's gamma, Megatron's `moe_router_bias_update_rate` default)
DEFAULT_BIAS_RATE = 1e-3


def routed_blocks(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The MoE layer blocks inside `modules` (those that count their tokens per expert), in order."""
    return [m for module in modules for m in module.modules()
            if hasattr(m, "tokens_per_expert") and getattr(m, "routed", False)]


def _dropped(block: nn.Module) -> torch.Tensor:
    """The block's slots dropped by the capacity this step, as one element beside its counts (zero without)."""
    counts = block.tokens_per_expert
    return counts.new_zeros(1) if block.dropped_slots is None else block.dropped_slots.reshape(1).to(counts)


class ExpertBalancer:
    """The expert load of this rank's MoE layer blocks after each step; moves their routers' balancing biases.

    `blocks` (`routed_blocks`), each with its layer `index`; `dp_group` the data-parallel ranks holding the same
    layers (None: one replica); `rate` the bias update rate."""

    def __init__(self, blocks: list[nn.Module], dp_group: dist.ProcessGroup | None = None, *,
                 rate: float = DEFAULT_BIAS_RATE) -> None:
        self.blocks, self.dp_group, self.rate = blocks, dp_group, rate
        #: layer index -> max / mean tokens per expert of the last step (summed over the replicas)
        self.imbalance: dict[int, float] = {}
        #: layer index -> (slots dropped by the capacity, slots routed) of the last step (summed over the replicas)
        self.dropped: dict[int, tuple[float, float]] = {}

    @torch.no_grad()
    def after_step(self) -> dict[int, float]:
        """Sum the step's counts over the replicas, move the biases, reset the counts; the imbalance per layer."""
        counted = [b for b in self.blocks if b.tokens_per_expert is not None]
        if not counted:
            return {}
        loads = torch.stack([torch.cat([b.tokens_per_expert, _dropped(b)]) for b in counted])
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(loads, group=self.dp_group)
        loads, dropped = loads[:, :-1], loads[:, -1]
        mean = loads.mean(dim=1, keepdim=True)
        for block, load, average in zip(counted, loads, mean):
            block.tokens_per_expert = block.dropped_slots = None
            bias = block.balancing_bias()
            if bias is not None:
                bias.add_(torch.sign(average - load).to(bias.dtype), alpha=self.rate)
        ratios = (loads.max(dim=1).values / mean.squeeze(1).clamp_min(1e-9)).tolist()
        self.imbalance = {block.index: ratio for block, ratio in zip(counted, ratios)}
        self.dropped = {block.index: (lost, routed) for block, lost, routed
                        in zip(counted, dropped.tolist(), loads.sum(dim=1).tolist())}
        return self.imbalance

    def line(self, imbalance: dict[int, float], dropped: float | None = None) -> str:
        """One log line: each layer's max / mean tokens per expert; the fraction of slots dropped, when given."""
        return "expert load (max/mean tokens per expert) by layer: " + ", ".join(
            f"{layer}: {ratio:.2f}" for layer, ratio in sorted(imbalance.items())) + (
            "" if dropped is None else f"; dropped {100 * dropped:.2f}% of token-slots (capacity)")
