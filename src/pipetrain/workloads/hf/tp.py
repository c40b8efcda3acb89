"""The tensor-parallel plans of the Hugging Face causal LM blocks (`HFCausalLM.tp_plan`): Megatron's split.

Llama, each decoder layer: q/k/v projections column-parallel (contiguous rows = whole heads: rank r holds query
heads r·h/tp.. and the key/value heads they read under GQA), `o_proj` row-parallel; the MLP's `gate_proj` and
`up_proj` column-parallel, `down_proj` row-parallel (the mapping of transformers' own `base_model_tp_plan`).
The attention and the MLP each take their input as one replicated DTensor (`PrepareModuleInput`), so the
backward sums the input gradients of q, k and v (of gate and up) in one all-reduce: two all-reduces forward and
two backward per layer. transformers' attention reshapes with `view(..., -1, head_dim)` and reads only the
ratio `num_key_value_groups`, and the rotary tables and the causal mask do not depend on the head count, so
the layer runs on its local heads unchanged. Embedding, norms and the head are kept whole on every TP rank.

GPT-2 (`Conv1D` layers, weights stored `[in, out]`, transposed against `nn.Linear`): `c_attn` (the fused
`[q | k | v]`, `[E, 3E]`) is split by heads along dim 1 with the strided placement `strided_shard(3, dim=1)`, its
bias replicated; the attention's `split_size` becomes the local width; `c_proj` and the MLP's `c_proj` are
row-parallel (`Shard(0)`), `c_fc` column-parallel (`Shard(1)`), see `Conv1DParallel`.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from pipetrain.compat.tensor_styles import Conv1DParallel, LocalSplitSize
from pipetrain.errors import ConfigError
from pipetrain.parallel.tensor import TPPlan

__all__ = ["hf_tp_plan", "llama_tp_plan", "gpt2_tp_plan", "Conv1DParallel", "LocalSplitSize"]


def _divides(tp: int, sizes: dict[str, int]) -> None:
    """One ConfigError naming every size of the config that tp does not divide, and the tp values that work."""
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        common = [d for d in range(1, min(sizes.values()) + 1) if all(s % d == 0 for s in sizes.values())]
        listed = ", ".join(f"{name}={size}" for name, size in bad.items())
        raise ConfigError(f"tp={tp} does not divide the model's {listed} (a tensor-parallel rank holds whole heads "
                          f"and an equal share of the MLP)",
                          hint=f"pass --tp among {', '.join(map(str, common))} (the common divisors of "
                               f"{', '.join(f'{n}={s}' for n, s in sizes.items())})")


def llama_tp_plan(config: Any, tp: int) -> TPPlan:
    """A Llama decoder layer's plan (submodule names inside pipetrain's `_DecoderLayer`)."""
    _divides(tp, {"num_attention_heads": config.num_attention_heads,
                  "num_key_value_heads": config.num_key_value_heads or config.num_attention_heads,
                  "intermediate_size": config.intermediate_size})
    replicated = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                    desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=False)
    return {
        "layer.self_attn": replicated,
        "layer.self_attn.q_proj": ColwiseParallel(), "layer.self_attn.k_proj": ColwiseParallel(),
        "layer.self_attn.v_proj": ColwiseParallel(), "layer.self_attn.o_proj": RowwiseParallel(),
        "layer.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                        use_local_output=False),
        "layer.mlp.gate_proj": ColwiseParallel(), "layer.mlp.up_proj": ColwiseParallel(),
        "layer.mlp.down_proj": RowwiseParallel(),
    }


def gpt2_tp_plan(config: Any, tp: int) -> TPPlan:
    """A GPT-2 block's plan (submodule names inside pipetrain's `_DecoderLayer`)."""
    inner = config.n_inner or 4 * config.hidden_size
    _divides(tp, {"n_head": config.num_attention_heads, "n_inner": inner})
    return {"layer.attn": LocalSplitSize(), "layer.attn.c_attn": Conv1DParallel("colwise", parts=3),
            "layer.attn.c_proj": Conv1DParallel("rowwise"),
            "layer.mlp.c_fc": Conv1DParallel("colwise"), "layer.mlp.c_proj": Conv1DParallel("rowwise")}


def hf_tp_plan(config: Any, family: str, index: int, num_blocks: int, tp: int, *,
               sequence_parallel: bool = False) -> TPPlan:
    """Block `index`'s plan: decoder layers split as above, embedding (0) and head (last) whole."""
    plan = llama_tp_plan(config, tp) if family == "llama" else gpt2_tp_plan(config, tp)
    if sequence_parallel:
        raise ConfigError(f"--sequence-parallel is not available for the Hugging Face {family} model's TP plan in "
                          "this version (its norms and head stay whole)",
                          hint="drop --sequence-parallel (tensor parallelism without it is exact)")
    return None if index in (0, num_blocks - 1) else plan
