"""OLMo-2 (`model_type` "olmo2"): Llama's layout with post-norms and q/k norms over the whole projections.

Each layer normalises the attention's and the MLP's outputs (`post_attention_layernorm`,
`post_feedforward_layernorm`) before adding them to the residual, with no norm before them; its q and k norms
run over the whole projection (weights of `num_attention_heads * head_dim` and `num_key_value_heads * head_dim`).

TP: a norm over all heads cannot run on one rank's heads, so q, k and v are all-gathered after their column-
parallel projections (every rank attends over all heads) and `o_proj` takes its slice of the replicated input, as
transformers' own plan for OLMo-2 does; the MLP is split as Llama's (`gathered_attention_tp_plan`).
"""

from __future__ import annotations

from pipetrain.workloads.hf.families.family import Family
from pipetrain.workloads.hf.families.llama import gathered_attention_tp_plan

__all__ = ["OLMO2"]

OLMO2 = Family(
    name="olmo2",
    embed="model.embed_tokens", layers="model.layers", norm="model.norm",
    layer_class="Olmo2DecoderLayer", norm_class="Olmo2RMSNorm", norm_eps="rms_norm_eps",
    rotary_class="Olmo2RotaryEmbedding", position_ids=True,
    qkv_bias="attention_bias", o_bias="attention_bias", qk_norm="projection", post_norms=True,
    tp_plan=gathered_attention_tp_plan,
)
