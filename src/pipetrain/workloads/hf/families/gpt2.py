"""GPT-2 (`model_type` "gpt2"): its description and TP plan.

TP (`Conv1D` layers, weights stored `[in, out]`, transposed against `nn.Linear`): `c_attn` (the fused
`[q | k | v]`, `[E, 3E]`) is split by heads along dim 1 with the strided placement `strided_shard(3, dim=1)`, its
bias replicated; the attention's `split_size` becomes the local width; `c_proj` and the MLP's `c_proj` are
row-parallel (`Shard(0)`), `c_fc` column-parallel (`Shard(1)`), see `Conv1DParallel`.
"""

from __future__ import annotations

from typing import Any

from pipetrain.compat.tensor_styles import Conv1DParallel, LocalSplitSize
from pipetrain.parallel.tensor import TPPlan
from pipetrain.workloads.hf.families.family import Family, tp_divides

__all__ = ["GPT2", "gpt2_tp_plan"]


def gpt2_tp_plan(config: Any, tp: int) -> TPPlan:
    """A GPT-2 block's plan (submodule names inside pipetrain's layer block)."""
    inner = config.n_inner or 4 * config.hidden_size
    tp_divides(tp, {"n_head": config.num_attention_heads, "n_inner": inner})
    return {"layer.attn": LocalSplitSize(), "layer.attn.c_attn": Conv1DParallel("colwise", parts=3),
            "layer.attn.c_proj": Conv1DParallel("rowwise"),
            "layer.mlp.c_fc": Conv1DParallel("colwise"), "layer.mlp.c_proj": Conv1DParallel("rowwise")}


GPT2 = Family(
    name="gpt2",
    embed="transformer.wte", position="transformer.wpe", layers="transformer.h", norm="transformer.ln_f",
    layer_class="GPT2Block", norm_class="torch.nn.LayerNorm", norm_eps="layer_norm_epsilon",
    embed_padding=False, embed_dropout="embd_pdrop", scaled_init="c_proj",
    fused_qkv="attn.c_attn", qkv_bias=True, o_bias=True, mlp_bias=True,
    lora_targets=("c_attn", "c_proj", "c_fc"),
    tp_plan=gpt2_tp_plan,
)
