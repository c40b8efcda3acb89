"""The mixture-of-experts families: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3 and GPT-OSS, each Llama's
layout (`model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`, `model.rotary_emb`) built from transformers'
own decoder layers, described by what differs. A layer's MoE block holds transformers' router (the module its
pretrained model records "router_logits" from) and its fused experts module (`mlp.experts`: `gate_up_proj
[E, 2I, H]`, `down_proj [E, H, I]`, called as `experts(hidden, top_k_index, top_k_weights)`); the folders store the
experts one by one and are read through transformers' conversion (`hf/checkpoint.py`).

- Qwen3-MoE: q/k norms over `head_dim`; dense layers where `mlp_only_layers` / `decoder_sparse_step` say.
- Qwen2-MoE: biases on q, k, v; a shared expert beside the routed ones, scaled by its own sigmoid gate
  (`mlp.shared_expert`, `mlp.shared_expert_gate`); sliding layers per `config.layer_types`.
- Mixtral: the experts under `block_sparse_moe` on disk (renamed to `mlp` on load); sliding when `sliding_window`.
- OLMoE: q/k norms over the whole projections; no sliding window.
- DeepSeek-V3: multi-head latent attention (`q_a_proj`/`kv_a_proj_with_mqa` low-rank projections), the first
  `first_k_dense_replace` layers dense, shared experts, sigmoid router with group-limited top-k, and the
  `e_score_correction_bias` of auxiliary-loss-free balancing (`pipetrain.moe.balance`); transformers' causal LM
  adds no load-balancing loss for it, so neither does pipetrain.
- GPT-OSS: attention sinks, sliding and full layers alternating per `config.layer_types`, biases on every
  projection, clamped SwiGLU experts with biases (stored fused, as in memory).

Tensor parallelism (`--tp`) splits the attention of Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE as Llama's (whole heads
per rank; OLMoE's q/k norms over the whole projections with the outputs gathered) and keeps the MoE block whole on
every TP rank: the attention's row-parallel output is the same on each, so each routes the same tokens and its
router and experts get the same gradients (no reduction over TP). DeepSeek-V3 (latent attention) and GPT-OSS
(per-head sinks) have no plan. Splitting the experts is `--ep`'s (over the data-parallel ranks of each TP rank).
None of these transformers classes computes a router z-loss, so none is added.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipetrain.parallel.tensor import TPPlan

from pipetrain.workloads.hf.families.family import Family, causal_mask, layer_types_mask, sliding_window_mask
from pipetrain.workloads.hf.families.llama import LLAMA, attention_tp_plan

__all__ = ["QWEN3_MOE", "QWEN2_MOE", "MIXTRAL", "OLMOE", "DEEPSEEK_V3", "GPT_OSS", "MOE_FAMILIES"]

_MOE = {"tp_plan": None, "sequence_tp_plan": None, "qkv_bias": False, "o_bias": False, "mlp_bias": False,
        "lora_targets": ("q_proj", "k_proj", "v_proj", "o_proj")}


def _moe(name: str, prefix: str, **fields: object) -> Family:
    return replace(LLAMA, name=name, layer_class=f"{prefix}DecoderLayer", norm_class=f"{prefix}RMSNorm",
                   rotary_class=f"{prefix}RotaryEmbedding", **{**_MOE, **fields})


def _gathered_attention_tp_plan(config: Any, tp: int) -> TPPlan:
    return attention_tp_plan(config, tp, gathered=True)


QWEN3_MOE = _moe("qwen3_moe", "Qwen3Moe", experts="num_experts", mask=sliding_window_mask, qk_norm="head",
                 qkv_bias="attention_bias", o_bias="attention_bias", tp_plan=attention_tp_plan)
QWEN2_MOE = _moe("qwen2_moe", "Qwen2Moe", experts="num_experts", mask=layer_types_mask, qkv_bias=True,
                 tp_plan=attention_tp_plan)
MIXTRAL = _moe("mixtral", "Mixtral", experts="num_local_experts", mask=sliding_window_mask, tp_plan=attention_tp_plan)
OLMOE = _moe("olmoe", "Olmoe", experts="num_experts", mask=causal_mask, qk_norm="projection",
             tp_plan=_gathered_attention_tp_plan)
DEEPSEEK_V3 = _moe("deepseek_v3", "DeepseekV3", experts="n_routed_experts", mask=causal_mask, aux_loss=False,
                   router_bias="e_score_correction_bias",
                   lora_targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
GPT_OSS = _moe("gpt_oss", "GptOss", experts="num_local_experts", mask=layer_types_mask, qkv_bias=True, o_bias=True)

#: the MoE families by model type
MOE_FAMILIES = {family.name: family for family in (QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE, DEEPSEEK_V3, GPT_OSS)}
