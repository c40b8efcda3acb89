"""`Family`: one transformers model type described once (its parts' places, its layers' inputs, its TP split).

`HFCausalLM` reads nothing else about a model type: the blocks are built from the classes named here (looked up
in `transformers.models.<name>.modeling_<name>`, or by their dotted path), their checkpoint keys are the attribute
paths named here, the mask a layer gets is the family's `mask` builder (causal, sliding window, per layer type),
and a decoder layer's tensor-parallel plan is `layer_tp_plan`. The fields that the layer class computes by itself
(biases, q/k norms, fused projections, post-norms) are described too, so a layer's sizes are read from the config
with the description alone (a test counts them against transformers' layer).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.compat.tensor_styles import heads_replicated
from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan

__all__ = ["Family", "causal_mask", "sliding_window_mask", "layer_types_mask", "transformers_mask",
           "require_transformers", "causal_lm_class", "default_attention", "tp_divides"]


def require_transformers() -> Any:
    """The `transformers` module, or a ConfigError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("Hugging Face models need the 'transformers' package",
                          hint="pip install 'pipetrain[hf]'") from None
    return transformers


def causal_lm_class(config: Any) -> type[nn.Module]:
    """transformers' causal LM class for `config` (`AutoModelForCausalLM`'s mapping), or a ConfigError."""
    mapping = require_transformers().models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        return mapping[type(config)]
    except KeyError:
        raise ConfigError(f"Hugging Face model type {config.model_type!r} is not supported: it has no description in "
                          "pipetrain and transformers has no causal LM class for it",
                          hint="pass a causal decoder LM (one AutoModelForCausalLM loads)") from None


def default_attention(config: Any) -> str:
    """The attention transformers runs when the config names none: "sdpa", or "eager" for a class that cannot use
    sdpa (Gemma 2's soft-capped attention scores)."""
    try:
        return "sdpa" if getattr(causal_lm_class(config), "_supports_sdpa", True) else "eager"
    except ConfigError:
        return "sdpa"


def causal_mask(config: Any, hidden: torch.Tensor, index: int) -> Any:
    """transformers' causal mask for layer `index` (every layer the same), positions 0..n-1, no padding mask."""
    # positions are 0..n-1 (no packed sequences), so they need not be checked (that reads values: not on meta)
    return require_transformers().masking_utils.create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=None)


def sliding_window_mask(config: Any, hidden: torch.Tensor, index: int) -> Any:
    """Mistral's and Phi-3's mask: every layer sliding over `config.sliding_window` tokens when it is set, else
    causal (as `MistralModel` and `Phi3Model` choose their mask builder)."""
    masks = require_transformers().masking_utils
    build = masks.create_causal_mask if config.sliding_window is None else masks.create_sliding_window_causal_mask
    return build(config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=None)


def layer_types_mask(config: Any, hidden: torch.Tensor, index: int) -> Any:
    """Qwen2's and Qwen3's mask: layer `index` slides when `config.layer_types[index]` is "sliding_attention",
    else causal (`Qwen2Model`'s mapping of layer types to masks)."""
    masks = require_transformers().masking_utils
    sliding = config.layer_types[index] == "sliding_attention"
    build = masks.create_sliding_window_causal_mask if sliding else masks.create_causal_mask
    return build(config=config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=None)


def transformers_mask(config: Any, hidden: torch.Tensor, index: int) -> Any:
    """The mask of a family without a description (the generic one), picked as transformers' models pick it:
    per `config.layer_types` when the config lists one type per layer, else sliding when `config.sliding_window`
    is set, else causal."""
    types = getattr(config, "layer_types", None)
    if types is not None and len(types) == config.num_hidden_layers:
        return layer_types_mask(config, hidden, index)
    return sliding_window_mask(config, hidden, index) if getattr(config, "sliding_window", None) is not None \
        else causal_mask(config, hidden, index)


def tp_divides(tp: int, sizes: dict[str, int]) -> None:
    """One ConfigError naming every size of the config that tp does not divide, and the tp values that work."""
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        common = [d for d in range(1, min(sizes.values()) + 1) if all(s % d == 0 for s in sizes.values())]
        listed = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ConfigError(f"tp={tp} does not divide the model's {listed} (a tensor-parallel rank holds whole heads "
                          f"and an equal share of the MLP)",
                          hint=f"pass --tp among {', '.join(map(str, common))} (the common divisors of "
                               f"{', '.join(f'{n}={s}' for n, s in sizes.items())})")


@dataclass(frozen=True, kw_only=True)
class Family:
    """One transformers causal LM type, as pipetrain splits it into embedding, decoder layers and head."""

    #: the config's `model_type`, and the transformers module its classes live in (`models.<name>.modeling_<name>`)
    name: str
    # -- where the parts live in the transformers model (attribute paths = checkpoint key prefixes) --
    embed: str  #: the token embedding, e.g. "model.embed_tokens"; its first component is the base model
    layers: str  #: the `ModuleList` of decoder layers, e.g. "model.layers"
    norm: str  #: the final norm, e.g. "model.norm"
    head: str = "lm_head"  #: the output projection (an `nn.Linear(hidden, vocab, bias=False)`)
    position: str | None = None  #: a learned position embedding (GPT-2's "transformer.wpe"), or None
    # -- how the parts are built (class names in the modeling module; a dotted name is imported as it is) --
    layer_class: str  #: the decoder layer, built as `cls(config, layer_index)`
    norm_class: str  #: the final norm, built as `cls(hidden_size, eps=config.<norm_eps>)`
    norm_eps: str  #: the config field of the norm's epsilon
    rotary_class: str | None = None  #: the rotary tables, built as `cls(config)` in each layer block; None: none
    # -- the embedding --
    embed_padding: bool = True  #: the token embedding's `padding_idx` is `config.pad_token_id`
    embed_dropout: str | None = None  #: the config field of the dropout after the embedding, or None
    embed_scale: bool = False  #: the embedding is multiplied by sqrt(hidden_size) (Gemma)
    embed_multiplier: str | None = None  #: the config field the embedding is multiplied by (Granite's
    #: "embedding_multiplier"), or None
    # -- the logits (after the head; in this order: multiplied, divided, soft-capped) --
    logit_multiplier: str | None = None  #: the config field the logits are multiplied by (Cohere's "logit_scale")
    logit_divisor: str | None = None  #: the config field the logits are divided by (Granite's "logits_scaling")
    logit_softcap: str | None = None  #: the config field of the soft cap, `cap * tanh(logits / cap)` when it is
    #: set (Gemma 2's "final_logit_softcapping"), or None
    tie: str | None = "tie_word_embeddings"  #: the config field that ties the head to the embedding (None: never)
    # -- what a decoder layer takes besides the hidden states --
    position_ids: bool = False  #: `position_ids=` (0..n-1); `position_embeddings=` whenever `rotary_class` is set
    rotary_by_layer_type: bool = False  #: the rotary tables are called with the layer's type (Gemma 3: local and
    #: global layers rotate with different bases)
    mask: Callable[[Any, torch.Tensor, int], Any] = causal_mask  #: `attention_mask=` (config, hidden, layer index)
    # -- what the decoder layer holds (its sizes, read from the config with these; the layer class computes it) --
    qkv_bias: bool | str = False  #: q/k/v projections have biases: True (Qwen2), False, or the config field that
    #: says (Llama's "attention_bias")
    o_bias: bool | str = False  #: the attention's output projection has a bias (True, False or a config field)
    mlp_bias: bool | str = False  #: the MLP's projections have biases (True, False or a config field: "mlp_bias")
    qk_norm: str | None = None  #: a norm on queries and keys: "head" (over head_dim, one weight of head_dim shared
    #: by the heads: Qwen3) or "projection" (over the whole q / k projection, weights of heads * head_dim: OLMo-2)
    fused_qkv: str | None = None  #: one projection holding [q | k | v] (Phi-3's "self_attn.qkv_proj"), or None
    fused_gate_up: str | None = None  #: one projection holding [gate | up] (Phi-3's "mlp.gate_up_proj"), or None
    post_norms: bool = False  #: norms after attention and MLP (OLMo-2) instead of before them
    sandwich_norms: bool = False  #: norms both before and after attention and MLP (Gemma 2 and 3: four a layer)
    parallel_block: bool = False  #: attention and MLP read one norm's output and are added (Cohere: one norm)
    #: the leaf names of the attention and MLP projections (LoRA's default targets, `--lora-targets`)
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # -- initialisation and tensor parallelism --
    norm_init: float = 1.0  #: every norm weight's initial value (Gemma's zero-centred `x * (1 + weight)`: 0.0)
    scaled_init: str | None = None  #: modules ending so get std / sqrt(2 * layers) (GPT-2's residual "c_proj")
    tp_plan: Callable[[Any, int], TPPlan] | None = None  #: (config, tp) -> a decoder layer's plan; raises when tp
    #: does not divide what it splits (whole heads, GQA's key/value heads too, the MLP width); a "head" q/k norm
    #: is added by `layer_tp_plan`
    #: the same under sequence parallelism (the layer takes and returns its sequence shard; None: not available)
    sequence_tp_plan: Callable[[Any, int], TPPlan] | None = None
    # -- a mixture of experts (docs/moe.md); None: a dense family --
    experts: str | None = None  #: the config field of the routed experts' count ("num_experts", "num_local_experts");
    #: the router is the module transformers records "router_logits" from (`_can_record_outputs`), the experts its
    #: sibling `experts` module (`forward(hidden, top_k_index, top_k_weights)`)
    aux_loss: bool = True  #: the family's causal LM adds the load-balancing loss (`output_router_logits`)
    router_bias: str | None = None  #: the router's balancing bias buffer (DeepSeek-V3's "e_score_correction_bias")

    @property
    def base(self) -> str:
        """The base model's attribute (`base_model_prefix`): a checkpoint of the base model omits it."""
        return self.embed.partition(".")[0]

    def has(self, what: str, config: Any) -> bool:
        """Whether `config`'s model has the feature `what` (a field naming a bool or a config field: "qkv_bias")."""
        value = getattr(self, what)
        return bool(getattr(config, value, False)) if isinstance(value, str) else bool(value)

    def ties(self, config: Any) -> bool:
        """Whether `config`'s output head is its input embedding matrix."""
        return self.tie is not None and bool(getattr(config, self.tie, False))

    def layer_tp_plan(self, config: Any, tp: int, *, sequence_parallel: bool = False) -> TPPlan:
        """A decoder layer's plan: `tp_plan`'s (`sequence_tp_plan`'s under `sequence_parallel`: a ConfigError when
        the family has none), plus, for a "head" q/k norm (applied to this rank's heads with the whole weight), the
        norms' weights replicated with their gradients summed over the TP ranks (what transformers' plan calls
        "replicated_with_grad_allreduce"); None when the family has no plan."""
        if self.tp_plan is None:
            return None
        if sequence_parallel and self.sequence_tp_plan is None:
            raise ConfigError(f"--sequence-parallel is not available for the Hugging Face {self.name} model's TP "
                              "plan in this version (its norms stay whole)",
                              hint="drop --sequence-parallel (tensor parallelism without it is exact)")
        plan = (self.sequence_tp_plan if sequence_parallel else self.tp_plan)(config, tp)  # type: ignore[misc]
        if plan is not None and self.qk_norm == "head":
            plan = {**plan, **{f"layer.self_attn.{name}": heads_replicated() for name in ("q_norm", "k_norm")}}
        return plan

    def router_class(self) -> tuple[type[nn.Module], int]:
        """The router's class and the index of its logits in its output: what the family's pretrained model records
        as "router_logits" (`_can_record_outputs`, transformers' output hooks); ConfigError when it records none."""
        require_transformers()
        module = importlib.import_module(f"transformers.models.{self.name}.modeling_{self.name}")
        for value in vars(module).values():
            recorder = (getattr(value, "_can_record_outputs", None) or {}).get("router_logits") \
                if isinstance(value, type) else None
            if recorder is not None:
                return recorder.target_class, recorder.index or 0
        raise ConfigError(f"the {self.name} family names experts ({self.experts}) but transformers' "
                          f"{module.__name__} records no router_logits", hint="describe the family without experts")

    def resolve(self, name: str) -> type[nn.Module]:
        """The class `name` of this family's modeling module (a dotted name: that module's class)."""
        module, _, cls = name.rpartition(".")
        require_transformers()
        return getattr(importlib.import_module(module or f"transformers.models.{self.name}.modeling_{self.name}"), cls)
