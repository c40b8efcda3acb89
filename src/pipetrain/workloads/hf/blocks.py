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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipetrain.context.attention import context_config
from pipetrain.errors import ConfigError
from pipetrain.moe.capacity import within_capacity
from pipetrain.moe.router import load_balancing_loss, router_statistics
from pipetrain.pipeline.recompute import is_recomputing
from pipetrain.workloads.hf.families import Family, causal_mask, require_transformers

__all__ = ["HFBlock", "Embedding", "DecoderLayer", "Head", "document_mask", "init_like_transformers",
           "carries_router_statistics", "num_experts"]


def num_experts(config: Any, family: Family) -> int:
    """The routed experts of each MoE layer (0: a dense family)."""
    return int(getattr(config, family.experts)) if family.experts else 0


def carries_router_statistics(config: Any, family: Family) -> bool:
    """Whether the load-balancing loss is on: a MoE family whose transformers causal LM adds it, with
    `config.output_router_logits` (as transformers' forward decides) and a non-zero `router_aux_loss_coef`."""
    return bool(family.experts and family.aux_loss and getattr(config, "output_router_logits", False)
                and getattr(config, "router_aux_loss_coef", 0.0))


class HFBlock(nn.Module):
    """A block whose parameters map to checkpoint keys by prefix (local prefix -> checkpoint prefix)."""

    prefixes: dict[str, str]

    def checkpoint_keys(self) -> Iterator[tuple[str, str]]:
        """(local name, checkpoint key) of every parameter and persistent buffer."""
        for name in self.state_dict():
            local = next(p for p in self.prefixes if name.startswith(p))
            yield name, self.prefixes[local] + name[len(local):]


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


class Embedding(HFBlock):
    """Token embedding (named as in the transformers model: `embed_tokens`, `wte`), scaled, plus positions."""

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        self.tokens, self.positions = _leaf(family.embed), family.position and _leaf(family.position)
        padding = config.pad_token_id if family.embed_padding else None
        self.add_module(self.tokens, nn.Embedding(config.vocab_size, config.hidden_size, padding))
        self.prefixes = {f"{self.tokens}.": f"{family.embed}."}
        if family.position is not None:
            self.add_module(self.positions, nn.Embedding(config.max_position_embeddings, config.hidden_size))
            self.prefixes[f"{self.positions}."] = f"{family.position}."
        self.drop = nn.Dropout(getattr(config, family.embed_dropout)) if family.embed_dropout else nn.Identity()
        self.scale = math.sqrt(config.hidden_size) if family.embed_scale else None
        self.multiplier = getattr(config, family.embed_multiplier) if family.embed_multiplier else None
        self.experts = num_experts(config, family) if carries_router_statistics(config, family) else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> Any:
        """The hidden states; with per-token `positions` (packed documents), `(hidden states, positions)`; with the
        load-balancing loss on, the router statistics (zero) after them."""
        at = torch.arange(input_ids.shape[1], device=input_ids.device)[None] if positions is None else positions
        out = (self.embed(input_ids, at),) + (() if positions is None else (positions,))
        if self.experts:
            out += (torch.zeros(input_ids.shape[0], 2, self.experts, device=input_ids.device),)
        return out[0] if len(out) == 1 else out

    def embed(self, input_ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The hidden states of `input_ids` at positions `at`: the token embedding, scaled and multiplied as the
        family says, plus the position embedding where there is one, then the dropout."""
        hidden = self.get_submodule(self.tokens)(input_ids)
        if self.scale is not None:  # in the embedding's dtype, as transformers does
            hidden = hidden * torch.tensor(self.scale, dtype=hidden.dtype)
        if self.multiplier is not None:  # a Python float, as transformers multiplies (Granite)
            hidden = hidden * self.multiplier
        if self.positions:
            hidden = hidden + self.get_submodule(self.positions)(at)
        return self.drop(hidden)


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
        self._routed = _RouterOutputs()
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

    def forward(self, hidden: torch.Tensor, *extra: torch.Tensor) -> Any:
        """The layer's output; with per-token `positions` (packed documents: they restart at each document),
        `(output, positions)`, the mask then block-diagonal by document (`document_mask`), built here per
        micro-batch from the positions that crossed the stage boundary with the hidden states; with the router
        statistics last (the load-balancing loss on), this layer's added to them."""
        statistics = extra[-1] if self.carries else None
        positions = extra[0] if len(extra) > self.carries else None
        if hidden.device.type == "meta" and self.routed:
            with _shapes_only([parent.experts for parent in self._moe_blocks]):
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


class _RouterOutputs(list):
    """A router's forward hook keeping (logits, chosen experts, dropped slots or None) of each call (an object, not
    a closure: a deep copy of the block, as `pipetrain check` makes, hooks its own copy). With a `capacity`, the
    router's output (logits, top-k weights, top-k experts) is returned with the weights of the slots beyond each
    expert's capacity zeroed (`pipetrain.moe.capacity.within_capacity`)."""

    at = 0  #: the index of the logits in the router's output
    capacity: float | None = None  #: the expert capacity factor (None: nothing dropped)
    experts = 0  #: the layer's routed experts

    def __call__(self, module: nn.Module, args: Any, out: tuple[torch.Tensor, ...]) -> Any:
        chosen = out[-1]
        if self.capacity is None or chosen.device.type == "meta":
            self.append((out[self.at], chosen, None))
            return None
        keep = within_capacity(chosen, self.experts, self.capacity)
        self.append((out[self.at], chosen, (~keep).sum()))
        return (*out[:-2], out[-2] * keep.to(out[-2].dtype), chosen)


@contextmanager
def _shapes_only(experts: list[nn.Module]) -> Iterator[None]:
    """On the meta device (shape inference): each experts module returns zeros of its input's shape, which is its
    output's (transformers' expert kernels group tokens by the router's choice, values the meta device has not)."""
    for module in experts:
        module.forward = lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)
    try:
        yield
    finally:
        for module in experts:
            del module.forward

    def rotary_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> Any:
        """The rotary tables (cos, sin) at `positions`, of this layer's type where the family has one per type."""
        by_type = () if self.layer_type is None else (self.layer_type,)  # Gemma 3: local or global tables
        return self.rotary(hidden, positions, *by_type)


class Head(HFBlock):
    """The final norm (`norm`) and the output projection (`lm_head`), then the family's logit multiplier, divisor and
    soft cap (each a value of the config, or None), in the order and the arithmetic of the transformers class."""

    def __init__(self, config: Any, family: Family) -> None:
        super().__init__()
        self.norm = family.resolve(family.norm_class)(config.hidden_size, eps=getattr(config, family.norm_eps))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.prefixes = {"norm.": f"{family.norm}.", "lm_head.": f"{family.head}."}
        self.multiplier, self.divisor, self.softcap = (
            None if field is None else getattr(config, field)
            for field in (family.logit_multiplier, family.logit_divisor, family.logit_softcap))

        self.carries = carries_router_statistics(config, family)
        self.top_k = getattr(config, "num_experts_per_tok", 0)

    def forward(self, hidden: torch.Tensor, *extra: torch.Tensor) -> Any:
        """The logits (the positions of packed documents end here); with the router statistics, `(logits, aux)`:
        the micro-batch's load-balancing loss, one copy per sample (`pipetrain.moe.router.RouterAuxLoss`)."""
        logits = self.logits(hidden)
        if not self.carries:
            return logits
        aux = load_balancing_loss(extra[-1], self.top_k)
        return logits, aux.expand(hidden.shape[0]).contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of `hidden`: normed, projected, then multiplied, divided and soft-capped as the family says."""
        logits = self.lm_head(self.norm(hidden))
        if self.multiplier is not None:  # Cohere
            logits = logits * self.multiplier
        if self.divisor is not None:  # Granite
            logits = logits / self.divisor
        if self.softcap is not None:  # Gemma 2 and 3
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def document_mask(family_mask: Any, config: Any, hidden: torch.Tensor, positions: torch.Tensor, index: int) -> Any:
    """The attention mask of packed documents: a token attends to the earlier tokens of its own document only (a
    document starts where the positions do not go up by one). For the causal families, transformers' own
    packed-sequence path (`create_causal_mask` with `position_ids`: `find_packed_sequence_indices`); for another
    mask (sliding windows), the family's mask of the window and-ed with the same-document blocks. On the meta
    device (shape inference) the family's mask: the documents need the positions' values, which meta has not."""
    if hidden.device.type == "meta":
        return family_mask(config, hidden, index)
    masks = require_transformers().masking_utils
    if family_mask is causal_mask:
        return masks.create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                        position_ids=positions)
    mask = family_mask(config, hidden, index)
    documents = masks.find_packed_sequence_indices(positions)
    if documents is None:
        return mask
    same = documents[:, None, :, None] == documents[:, None, None, :]
    if mask is None:  # the family's mask is plain causal (sdpa's is_causal)
        length = hidden.shape[1]
        return same & torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return mask & same
    if isinstance(mask, torch.Tensor):  # an additive float mask (eager attention)
        return mask.masked_fill(~same, torch.finfo(mask.dtype).min)
    raise ConfigError(f"--pack documents cannot combine the {config._attn_implementation} attention's "
                      f"{type(mask).__name__} mask with documents", hint="use attn_implementation 'sdpa' or 'eager'")


def init_like_transformers(block: nn.Module, config: Any, family: Family) -> None:
    """transformers' initialisation: normal(0, initializer_range) weights, zero biases, norms at the family's
    `norm_init` (1; Gemma's zero-centred norms 0, as `GemmaPreTrainedModel._init_weights` does); the family's
    `scaled_init` modules (GPT-2's residual projections) with std / sqrt(2 * layers); another module's own matrices
    (fused experts, a router's) and GPT-OSS's sinks normal(0, std), its own biases zero."""
    conv1d = require_transformers().pytorch_utils.Conv1D
    std = config.initializer_range
    with torch.no_grad():
        for name, module in block.named_modules():
            if isinstance(module, (nn.Linear, conv1d, nn.Embedding)):
                scaled = family.scaled_init is not None and name.endswith(family.scaled_init)
                module.weight.normal_(0.0, std / math.sqrt(2 * config.num_hidden_layers) if scaled else std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
                module.weight.fill_(family.norm_init)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            else:  # parameters of their own (a MoE layer's fused experts and router, GPT-OSS's sinks) as
                # transformers' `_init_weights` draws them: matrices and sinks normal(0, std), biases zero
                for name, param in module.named_parameters(recurse=False):
                    if param.dim() >= 2 or name == "sinks":
                        param.normal_(0.0, std)
                    elif name.endswith("bias"):
                        param.zero_()
