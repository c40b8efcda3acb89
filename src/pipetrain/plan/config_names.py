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
    layer_norm: bool = False
    qkv_bias: str | bool = "attention_bias"
    o_bias: str | bool = "attention_bias"
    mlp_bias: str | bool = False
    qk_norm: str | None = None  #: "head": norms over head_dim (Qwen3); "projection": over the whole q, k (OLMo-2)
    dropout: str | None = None  #: the field of the residual dropout rate (its masks are kept for backward)
    dropout_default: float = 0.0
    note: str = ""  #: what sets the family apart, for messages and docs


#: model_type -> its config's names (field names of transformers 5.24's configuration classes)
CONFIG_NAMES: dict[str, ConfigNames] = {
    "llama": ConfigNames(mlp_bias="mlp_bias", note="hidden_size, intermediate_size, num_hidden_layers, "
                         "num_attention_heads, num_key_value_heads, head_dim, attention_bias, mlp_bias"),
    "qwen2": ConfigNames(qkv_bias=True, o_bias=False, note="as llama, with biases on q, k and v"),
    "qwen3": ConfigNames(qk_norm="head", note="as llama, with q/k norms over the head dimension"),
    "mistral": ConfigNames(qkv_bias=False, o_bias=False, note="as llama, no biases"),
    "gemma": ConfigNames(tied_default=True, note="as llama, with head_dim, tied by default"),
    "phi3": ConfigNames(qkv_bias=False, o_bias=False, dropout="resid_pdrop",
                        note="as llama, fused qkv_proj and gate_up_proj, no biases"),
    "olmo2": ConfigNames(qk_norm="projection", note="as llama, with q/k norms over the whole projection width"),
    "gpt2": ConfigNames(hidden="n_embd", layers="n_layer", heads="n_head", kv_heads=None, intermediate="n_inner",
                        intermediate_default=4, positions="n_positions", positions_default=1024, tied_default=True,
                        gated=False, layer_norm=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                        dropout="resid_pdrop", dropout_default=0.1,
                        note="n_embd, n_inner, n_layer, n_head, n_positions, LayerNorm, plain MLP, all biases"),
}
#: model_type -> what the family's config calls each size (kept for callers of the first name)
FAMILY_FIELDS: dict[str, str] = {name: names.note for name, names in CONFIG_NAMES.items()}
