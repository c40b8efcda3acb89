"""The blocks of a Hugging Face causal LM, built from its `Family` description with transformers' own modules.

Three kinds: the embedding (token embedding, plus the position embedding where the family has one; scaled as the
family says), one block per decoder layer, and the head (final norm + LM head; the logits multiplied, divided and
soft-capped as the family says). Only the hidden states cross a stage boundary: each layer
block rebuilds the attention mask (and the rotary tables) from the sequence length, as the unsplit model builds
them once. With packed documents (`--pack documents`) the per-token positions cross with them, a second tensor,
and each layer block builds the block-diagonal causal mask from them (`document_mask`). A block's parameters keep
the names of the transformers model through `prefixes` (local -> checkpoint).

Mixtures of experts (docs/moe.md): each MoE layer block hooks its router (the module transformers records
"router_logits" from) and, when the load-balancing loss is on (`carries_router_statistics`), adds its layer's
per-sample router sums to a float tensor `[batch, 2, E]` that the embedding starts at zero and that crosses every
stage boundary last, after the hidden states (and the positions); the head turns it into the micro-batch's
load-balancing loss and returns `(logits, aux)` (`pipetrain.moe.router`). In training, each MoE layer block also
counts its tokens per expert (`tokens_per_expert`, never in a recomputed forward): the step's load imbalance and
DeepSeek-V3's bias balancing read them (`pipetrain.moe.balance`). With an expert capacity (`--moe-capacity`,
`pipetrain.moe.capacity`), the router's output hook zeroes the combine weights of the slots beyond it, and the
block counts them (`dropped_slots`).

The modules: `ends` (the block base, the embedding and the head), `routing` (a MoE layer's router hook), `masks`
(packed documents' mask), `init_weights` (transformers' initialisation); their names are importable from here.
"""

from __future__ import annotations

from typing import Any

import torch

from pipetrain.context.attention import context_config
from pipetrain.moe.router import router_statistics
from pipetrain.pipeline.recompute import is_recomputing
from pipetrain.workloads.hf.ends import Embedding, Head, HFBlock
from pipetrain.workloads.hf.families import Family
from pipetrain.workloads.hf.init_weights import init_like_transformers
from pipetrain.workloads.hf.masks import document_mask
from pipetrain.workloads.hf.routing import RouterOutputs, carries_router_statistics, num_experts, shapes_only

__all__ = ["HFBlock", "Embedding", "DecoderLayer", "Head", "document_mask", "init_like_transformers",
           "carries_router_statistics", "num_experts"]


class DecoderLayer(HFBlock):
    """One decoder layer (`layer`); rebuilds the attention mask and the rotary tables (`rotary`) from the length.
    `capacity`: the expert capacity factor of a MoE layer (None: no token dropped; `pipetrain.moe.capacity`)."""

    def __init__(self, config: Any, family: Family, index: int, *, capacity: float | None = None) -> None:
        super().__init__()
        self.config, self.index, self.mask, self.position_ids = config, index, family.mask, family.position_ids
        self.layer_type = config.layer_types[index] if family.rotary_by_layer_type else None
        self.layer = family.resolve(family.layer_class)(config, index)
        self.rotary = None if family.rotary_class is None else family.resolve(family.rotary_class)(config)
        self.prefixes = {"layer.": f"{family.layers}.{index}."}
        self.carries = carries_router_statistics(config, family)
        self.routed = False  #: whether this layer routes to experts (a MoE family's dense layers do not)
        self._bias: str | None = None
        #: this layer's routed tokens per expert since the last `reset` (training forwards, none recomputed)
        self.tokens_per_expert: torch.Tensor | None = None
        #: this layer's token-slots dropped by the expert capacity since the last reset (as `tokens_per_expert`)
        self.dropped_slots: torch.Tensor | None = None
        self._routed = RouterOutputs()
        if family.experts:
            router_class, at = family.router_class()
            router = next((m for m in self.layer.modules() if isinstance(m, router_class)), None)
            self.routed = router is not None
            self._bias = family.router_bias if router is not None and family.router_bias else None
            self._router = [router]  # a list: not a second path to the router's parameters
            #: the module holding the router and the experts beside it (transformers' `experts(hidden, top_k_index,
            #: top_k_weights)`), read at each meta forward: expert parallelism replaces the experts module there
            self._moe_blocks = [parent for parent in self.layer.modules()
                                if router is not None and any(c is router for c in parent.children())
                                and hasattr(parent, "experts")]
            if router is not None:  # an output hook, as transformers records `output_router_logits`: the
                # logits, and the experts the router chose (its last output, `top_k_index`)
                self._routed.at = at
                if capacity is not None:
                    self._routed.capacity, self._routed.experts = capacity, num_experts(config, family)
                router.register_forward_hook(self._routed)
            self.top_k = config.num_experts_per_tok
        self.context: Any = None  # a `pipetrain.context.ContextParallel` once attached (`use_context`)

    def use_context(self, context: Any) -> None:
        """Run attention over the sequence cut by context parallelism: the layer's attention modules take
        transformers' "pipetrain_context" attention function (a config copy local to this block), and the mask is
        the context's (`ContextMask`), built from the positions that cross the stage boundary."""
        context.check_config(self.config)
        config = context_config(self.config)
        for module in self.layer.modules():
            if getattr(module, "config", None) is self.config:
                module.config = config
        self.config, self.context = config, context
        self._routed.context = context  # an expert capacity serves the slots of the whole sequences

    def forward(self, hidden: torch.Tensor, *extra: torch.Tensor) -> Any:
        """The layer's output; with per-token `positions` (packed documents: they restart at each document),
        `(output, positions)`, the mask then block-diagonal by document (`document_mask`), built here per
        micro-batch from the positions that crossed the stage boundary with the hidden states; with the router
        statistics last (the load-balancing loss on), this layer's added to them."""
        statistics = extra[-1] if self.carries else None
        positions = extra[0] if len(extra) > self.carries else None
        self._routed.batch = hidden.shape[0]
        if hidden.device.type == "meta" and self.routed:
            with shapes_only([parent.experts for parent in self._moe_blocks]):
                out = self._layer(hidden, positions)
        else:
            out = self._layer(hidden, positions)
        if self.routed:
            logits, chosen, dropped = self._routed.pop()
            self._routed.clear()
            if self.training and not is_recomputing() and hidden.device.type != "meta":
                self._count(chosen, logits.shape[-1], dropped)
            if statistics is not None:
                statistics = statistics + router_statistics(logits, self.top_k, hidden.shape[0])
        rest = (() if positions is None else (positions,)) + (() if statistics is None else (statistics,))
        return (out, *rest) if rest else out

    def balancing_bias(self) -> torch.Tensor | None:
        """The router's balancing bias buffer (DeepSeek-V3's `e_score_correction_bias`), or None."""
        return None if self._bias is None else getattr(self._router[0], self._bias)

    def _count(self, chosen: torch.Tensor, experts: int, dropped: torch.Tensor | None = None) -> None:
        """Add this forward's routed tokens per expert (the experts the router chose, with its bias if any) and
        the slots the capacity dropped (`dropped`; None: no capacity)."""
        with torch.no_grad():
            counts = torch.bincount(chosen.flatten(), minlength=experts).to(torch.float32)
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
            if dropped is not None:
                dropped = dropped.to(torch.float32)
                self.dropped_slots = dropped if self.dropped_slots is None else self.dropped_slots + dropped

    def _layer(self, hidden: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        packed = positions is not None
        if self.context is not None and packed:  # context parallelism: positions are global (or per document)
            mask = self.context.mask(hidden, positions)
        elif packed:
            mask = document_mask(self.mask, self.config, hidden, positions, self.index)
        else:
            mask = self.mask(self.config, hidden, self.index)
            positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        inputs: dict[str, Any] = {"attention_mask": mask}
        if self.position_ids:
            inputs["position_ids"] = positions
        if self.rotary is not None:
            inputs["position_embeddings"] = self.rotary_tables(hidden, positions)
        return self.layer(hidden, **inputs)

    def rotary_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        """The rotary tables (cos, sin) at `positions`, of this layer's type where the family has one per type."""
        by_type = () if self.layer_type is None else (self.layer_type,)  # Gemma 3: local or global tables
        return self.rotary(hidden, positions, *by_type)
