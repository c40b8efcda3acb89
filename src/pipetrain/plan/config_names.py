"""How each decoder family's `config.json` names its sizes: one `ConfigNames` description per model_type, the
planner's only knowledge of families (`pipetrain.plan.transformer.sizes_from_config` reads them all alike)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConfigNames", "CONFIG_NAMES", "FAMILY_FIELDS"]


@dataclass(frozen=True, kw_only=True)
class ConfigNames:
    """How one family's `config.json` names its sizes, and what its layers hold besides: a description per
    model_type (`CONFIG_NAMES`), read by `sizes_from_config` alike for every family. A bias is a config field
    (read as a bool) or a fixed value."""

    hidden: str = "hidden_size"
    layers: str = "num_hidden_layers"
    heads: str = "num_attention_heads"
    kv_heads: str | None = "num_key_value_heads"  #: None: one key/value head per query head
    intermediate: str = "intermediate_size"
    intermediate_default: int | None = None  #: the MLP width as a multiple of hidden when the field is unset
    positions: str | None = None  #: the field of a learned position embedding's rows (GPT-2's n_positions)
    positions_default: int = 0
    tied_default: bool = False  #: whether the head is tied when the config does not say
    gated: bool = True
    fused_qkv: bool = False  #: q, k and v are one matrix product (GPT-2's c_attn, Phi-3's qkv_proj)
    fused_gate_up: bool = False  #: the gate and up projections are one matrix product (Phi-3's gate_up_proj)
    layer_norm: bool = False
    qkv_bias: str | bool = "attention_bias"
    o_bias: str | bool = "attention_bias"
    mlp_bias: str | bool = False
    qk_norm: str | None = None  #: "head": norms over head_dim (Qwen3); "projection": over the whole q, k (OLMo-2)
    dropout: str | None = None  #: the field of the residual dropout rate (its masks are kept for backward)
    dropout_default: float = 0.0
    note: str = ""  #: what sets the family apart, for messages and docs
    # -- a mixture of experts (None: a dense family) --
    #: the fields that may hold the routed experts per MoE layer (the first present; transformers' attribute maps
    #: write `num_local_experts` where a hub config says `num_experts`); () for a dense family
    experts: tuple[str, ...] = ()
    top_k: str = "num_experts_per_tok"  #: the field of the experts each token goes to
    expert_intermediate: str = "moe_intermediate_size"  #: the field of one expert's MLP width
    shared_intermediate: str | None = None  #: the field of an always-on shared expert's width (Qwen2-MoE)
    shared_gate: bool = False  #: the shared expert's output goes through a sigmoid gate, a Linear(hidden, 1)
    expert_bias: bool = False  #: the experts' projections and the router have biases (GPT-OSS)
    #: which layers are MoE: "all", or "qwen" (not in `mlp_only_layers`, every `decoder_sparse_step`-th)
    sparse_layers: str = "all"
    sinks: bool = False  #: each attention head has a learned sink logit (GPT-OSS)


_EXPERTS = ("num_experts", "num_local_experts")

#: model_type -> its config's names (field names of transformers 5.24's configuration classes)
CONFIG_NAMES: dict[str, ConfigNames] = {
    "llama": ConfigNames(mlp_bias="mlp_bias", note="hidden_size, intermediate_size, num_hidden_layers, "
                         "num_attention_heads, num_key_value_heads, head_dim, attention_bias, mlp_bias"),
    "qwen2": ConfigNames(qkv_bias=True, o_bias=False, note="as llama, with biases on q, k and v"),
    "qwen3": ConfigNames(qk_norm="head", note="as llama, with q/k norms over the head dimension"),
    "mistral": ConfigNames(qkv_bias=False, o_bias=False, note="as llama, no biases"),
    "gemma": ConfigNames(tied_default=True, note="as llama, with head_dim, tied by default"),
    "phi3": ConfigNames(qkv_bias=False, o_bias=False, dropout="resid_pdrop", fused_qkv=True, fused_gate_up=True,
                        note="as llama, fused qkv_proj and gate_up_proj, no biases"),
    "olmo2": ConfigNames(qk_norm="projection", note="as llama, with q/k norms over the whole projection width"),
    "qwen3_moe": ConfigNames(qk_norm="head", experts=_EXPERTS, sparse_layers="qwen",
                             note="as qwen3, MoE layers of num_experts experts (moe_intermediate_size wide), top "
                                  "num_experts_per_tok; dense layers: mlp_only_layers, decoder_sparse_step"),
    "qwen2_moe": ConfigNames(qkv_bias=True, o_bias=False, experts=_EXPERTS, sparse_layers="qwen",
                             shared_intermediate="shared_expert_intermediate_size", shared_gate=True,
                             note="as qwen3_moe with q/k/v biases and no q/k norms, plus a gated shared expert "
                                  "(shared_expert_intermediate_size)"),
    "mixtral": ConfigNames(qkv_bias=False, o_bias=False, experts=_EXPERTS,
                           expert_intermediate="intermediate_size",
                           note="as mistral, every layer num_local_experts experts of intermediate_size"),
    "olmoe": ConfigNames(qk_norm="projection", experts=_EXPERTS, expert_intermediate="intermediate_size",
                         note="as olmo2's q/k norms, every layer num_experts experts of intermediate_size"),
    "gpt_oss": ConfigNames(qkv_bias=True, o_bias=True, experts=_EXPERTS,
                           expert_intermediate="intermediate_size", expert_bias=True, sinks=True,
                           note="attention biases and sinks, every layer num_local_experts experts of "
                                "intermediate_size with biases, a router with a bias"),
    "gpt2": ConfigNames(hidden="n_embd", layers="n_layer", heads="n_head", kv_heads=None, intermediate="n_inner",
                        intermediate_default=4, positions="n_positions", positions_default=1024, tied_default=True,
                        gated=False, fused_qkv=True, layer_norm=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                        dropout="resid_pdrop", dropout_default=0.1,
                        note="n_embd, n_inner, n_layer, n_head, n_positions, LayerNorm, plain MLP, all biases"),
}
#: model_type -> what the family's config calls each size (kept for callers of the first name)
FAMILY_FIELDS: dict[str, str] = {name: names.note for name, names in CONFIG_NAMES.items()}
