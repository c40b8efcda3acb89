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
`[q | k | v]`, `[E, 3E]`) is split by heads along dim 1 with the strided placement `_StridedShard(1, 3)`, its
bias replicated; the attention's `split_size` becomes the local width; `c_proj` and the MLP's `c_proj` are
row-parallel (`Shard(0)`), `c_fc` column-parallel (`Shard(1)`), see `Conv1DParallel`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard  # guarded: tensor_styles.PRIVATE_DTENSOR

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


class Conv1DParallel(ParallelStyle):
    """transformers' `Conv1D` (`y = x @ W + b`, `W: [in, out]`) split over the mesh, plain local tensors out.

    `kind="colwise"`: W by output columns (`Shard(1)`, bias `Shard(0)`), the input taken as replicated, the
    output this rank's columns; `parts > 1` for a fused projection of `parts` stacked outputs (GPT-2's
    `[q | k | v]`): each part split by columns (`_StridedShard(1, parts)`, the bias replicated), the output
    part-major.
    `kind="rowwise"`: W by input rows (`Shard(0)`, bias replicated), the input this rank's columns, the output
    all-reduced. The module's forward is replaced by one on DTensors (`_conv1d_forward`)."""

    def __init__(self, kind: str, parts: int = 1) -> None:
        super().__init__()
        if kind not in ("colwise", "rowwise"):
            raise ValueError(f"kind {kind!r}: colwise or rowwise")
        self.kind, self.parts = kind, parts

    def _placements(self, name: str) -> Placement:
        if self.kind == "rowwise":
            return Shard(0) if name == "weight" else Replicate()
        if self.parts == 1:
            return Shard(1 if name == "weight" else 0)
        # a fused bias stays replicated (as `FusedColwiseParallel`'s): FSDP2 shards dim 0 of a 1-D tensor, which
        # would compose wrongly with a strided split; the add to the strided output slices it locally
        return _StridedShard(1, split_factor=self.parts) if name == "weight" else Replicate()

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            dist = distribute_tensor(param.detach(), mesh, [self._placements(pname)], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module).__name__ != "Conv1D" or module.weight.ndim != 2:
            raise ConfigError(f"Conv1DParallel splits transformers' Conv1D, got {type(module).__name__}",
                              hint="use torch's ColwiseParallel / RowwiseParallel for nn.Linear")
        distribute_module(module, device_mesh, self._partition)
        module.forward = partial(_conv1d_forward, module, mesh=device_mesh, rowwise=self.kind == "rowwise")
        return module


class LocalSplitSize(ParallelStyle):
    """GPT-2's attention splits its `c_attn` output into q, k, v with `split_size` (the hidden size): under TP
    the output is `3 * hidden / tp` wide, so the split becomes `hidden / tp` (the heads are read with -1)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.split_size = module.embed_dim // device_mesh.size()
        return module


def _conv1d_forward(self: nn.Module, x: torch.Tensor, *, mesh: DeviceMesh, rowwise: bool) -> torch.Tensor:
    """`addmm(b, x, W)` on DTensors: x replicated (colwise; backward all-reduces its gradient) or this rank's
    columns (rowwise); the result's local tensor (rowwise: all-reduced, then the bias added once)."""
    if rowwise:
        local = DTensor.from_local(x, mesh, [Shard(x.ndim - 1)], run_check=False)
        out = torch.matmul(local, self.weight).redistribute(mesh, [Replicate()])
        return (out + self.bias).to_local()
    replicated = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return (torch.matmul(replicated, self.weight) + self.bias).to_local()


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
