"""Phi-3 (`model_type` "phi3"): Llama's layout with fused projections and partial rotary tables.

Its attention holds one `qkv_proj` (`[q | k | v]`: `num_attention_heads * head_dim` rows of queries, then
`num_key_value_heads * head_dim` of keys and of values) and its MLP one `gate_up_proj` (`[gate | up]`, each
`intermediate_size` rows); the rotary tables cover `partial_rotary_factor * head_dim` of each head
(`config.rope_parameters`, read by `Phi3RotaryEmbedding`); every layer slides over `config.sliding_window`
tokens when it is set; dropout after attention and MLP (`resid_pdrop`, 0 by default).

TP: `gate_up_proj` is split as two stacked projections (`FusedColwiseParallel(2)`: rank r holds its rows of gate
and of up, so `chunk(2)` of its output gives its gate and its up), `down_proj` row-parallel. `qkv_proj`'s parts
are unequal under GQA and the attention slices them at `config.num_attention_heads * head_dim`, the global count,
so its output is all-gathered (every rank attends over all heads, whole q, k and v) and `o_proj` takes its slice
of the replicated input: transformers' own plan for Phi-3 ("colwise_gather_output", "rowwise_split_input").
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pipetrain.compat.tensor_styles import FusedColwiseParallel
from pipetrain.parallel.tensor import TPPlan
from pipetrain.workloads.hf.families.family import Family, sliding_window_mask, tp_divides
from pipetrain.workloads.hf.families.llama import decoder_tp_sizes

__all__ = ["PHI3", "phi3_tp_plan"]


def phi3_tp_plan(config: Any, tp: int) -> TPPlan:
    """A Phi-3 decoder layer's plan (submodule names inside pipetrain's layer block)."""
    tp_divides(tp, decoder_tp_sizes(config))
    return {"layer.self_attn.qkv_proj": ColwiseParallel(output_layouts=Replicate()),
            "layer.self_attn.o_proj": RowwiseParallel(input_layouts=Replicate()),
            "layer.mlp.gate_up_proj": FusedColwiseParallel(2), "layer.mlp.down_proj": RowwiseParallel()}


PHI3 = Family(
    name="phi3",
    embed="model.embed_tokens", layers="model.layers", norm="model.norm",
    layer_class="Phi3DecoderLayer", norm_class="Phi3RMSNorm", norm_eps="rms_norm_eps",
    rotary_class="Phi3RotaryEmbedding", position_ids=True, mask=sliding_window_mask,
    fused_qkv="self_attn.qkv_proj", fused_gate_up="mlp.gate_up_proj",
    lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    tp_plan=phi3_tp_plan,
)
