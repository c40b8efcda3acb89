"""The Llama family (`model_type` "llama": Llama 2/3, SmolLM2, TinyLlama): its description and TP plan.

TP, each decoder layer (Megatron's split): q/k/v projections column-parallel (contiguous rows = whole heads: rank r
holds query heads r·h/tp.. and the key/value heads they read under GQA, so tp divides the key/value heads too),
`o_proj` row-parallel; the MLP's `gate_proj` and `up_proj` column-parallel, `down_proj` row-parallel (the mapping
of transformers' own `base_model_tp_plan`). The attention and the MLP each take their input as one replicated
DTensor (`PrepareModuleInput`), so the backward sums the input gradients of q, k and v (of gate and up) in one
all-reduce: two all-reduces forward and two backward per layer. transformers' attention reshapes with
`view(..., -1, head_dim)` and reads only the ratio `num_key_value_groups`, and the rotary tables and the causal
mask do not depend on the head count, so the layer runs on its local heads unchanged.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from pipetrain.compat.tensor_styles import SEQUENCE, sequence_block

from pipetrain.parallel.tensor import TPPlan
from pipetrain.workloads.hf.families.family import Family, tp_divides

__all__ = ["LLAMA", "llama_tp_plan", "llama_sequence_tp_plan", "gathered_attention_tp_plan", "attention_tp_plan",
           "decoder_tp_sizes"]


def decoder_tp_sizes(config: Any) -> dict[str, int]:
    """What a decoder layer's TP split divides: the query heads, the key/value heads (GQA), the MLP width."""
    return {"num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "intermediate_size": config.intermediate_size}


def _replicated_input() -> PrepareModuleInput:
    return PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                              desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False)


def attention_tp_plan(config: Any, tp: int, *, gathered: bool = False) -> TPPlan:
    """A decoder layer's attention split (whole heads per rank; tp divides the query and key/value heads), the rest
    of the layer whole; `gathered`: q/k/v outputs all-gathered, each rank attending over all heads (for q/k norms
    over the whole projections: transformers' "colwise_gather_output", "rowwise_split_input")."""
    tp_divides(tp, {name: size for name, size in decoder_tp_sizes(config).items() if name != "intermediate_size"})
    projection = (lambda: ColwiseParallel(output_layouts=Replicate())) if gathered else ColwiseParallel
    return {
        "layer.self_attn": _replicated_input(),
        "layer.self_attn.q_proj": projection(), "layer.self_attn.k_proj": projection(),
        "layer.self_attn.v_proj": projection(),
        "layer.self_attn.o_proj": RowwiseParallel(input_layouts=Replicate()) if gathered else RowwiseParallel(),
    }


def llama_tp_plan(config: Any, tp: int) -> TPPlan:
    """A Llama decoder layer's plan (submodule names inside pipetrain's layer block)."""
    tp_divides(tp, decoder_tp_sizes(config))
    return {
        **attention_tp_plan(config, tp),
        "layer.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                        use_local_output=False),
        "layer.mlp.gate_proj": ColwiseParallel(), "layer.mlp.up_proj": ColwiseParallel(),
        "layer.mlp.down_proj": RowwiseParallel(),
    }


def llama_sequence_tp_plan(config: Any, tp: int) -> TPPlan:
    """Llama's plan under sequence parallelism (torchtitan's): the layer block takes this rank's sequence shard
    `[batch, seq / tp, hidden]` as a DTensor of the whole sequence (so the block builds its mask and rotary tables
    for the whole length) and returns its shard; the two RMSNorms and the residual adds run on the shard
    (`SequenceParallel`: their weights replicated, the gradients summed over TP); the attention and the MLP
    all-gather their input, `o_proj` and `down_proj` reduce-scatter their output back to the shard."""
    tp_divides(tp, decoder_tp_sizes(config))
    return {
        "": sequence_block(),
        "layer.input_layernorm": SequenceParallel(use_local_output=False),
        "layer.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": SEQUENCE},
                                              desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                              use_local_output=False),
        "layer.self_attn.q_proj": ColwiseParallel(), "layer.self_attn.k_proj": ColwiseParallel(),
        "layer.self_attn.v_proj": ColwiseParallel(),
        "layer.self_attn.o_proj": RowwiseParallel(output_layouts=SEQUENCE, use_local_output=False),
        "layer.post_attention_layernorm": SequenceParallel(use_local_output=False),
        "layer.mlp": PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),),
                                        use_local_output=False),
        "layer.mlp.gate_proj": ColwiseParallel(), "layer.mlp.up_proj": ColwiseParallel(),
        "layer.mlp.down_proj": RowwiseParallel(output_layouts=SEQUENCE, use_local_output=False),
    }


def gathered_attention_tp_plan(config: Any, tp: int) -> TPPlan:
    """Llama's MLP split, and an attention whose q/k/v outputs are all-gathered (each rank attends over all heads,
    `o_proj` takes its slice of the replicated input): for layers that read the whole projection, OLMo-2's q/k
    norms over all heads (transformers' own plan: "colwise_gather_output", "rowwise_split_input")."""
    return {**llama_tp_plan(config, tp), **attention_tp_plan(config, tp, gathered=True)}


LLAMA = Family(
    name="llama",
    embed="model.embed_tokens", layers="model.layers", norm="model.norm",
    layer_class="LlamaDecoderLayer", norm_class="LlamaRMSNorm", norm_eps="rms_norm_eps",
    rotary_class="LlamaRotaryEmbedding", position_ids=True,
    qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    tp_plan=llama_tp_plan, sequence_tp_plan=llama_sequence_tp_plan,
)
