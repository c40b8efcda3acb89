"""Tensor-parallel styles the built-in models need beyond torch's (each overrides private hooks of torch's styles): a
fused (q, k, v) projection and `nn.MultiheadAttention` split by heads, transformers' `Conv1D` (GPT-2), and the two
edges of a sequence-parallel region. All send plain local
tensors out (`use_local_output`).

A fused projection `[q; k; v]` (one `nn.Linear(E, 3E)`) cannot be split with `ColwiseParallel`: its contiguous
`Shard(0)` would give rank 0 all of q and half of k. `FusedColwiseParallel(3)` distributes it with the strided
placement `strided_shard(3)` (DTensor's `_StridedShard`): rank r holds rows r of q, of k and of v (its heads), while the
parameter is still one DTensor of the unsplit shape (`full_tensor()` gives the unsplit weight back).
"""

from __future__ import annotations

import math
from functools import partial
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from pipetrain.compat.dtensor import is_strided, strided_shard
from pipetrain.errors import ConfigError

__all__ = ["FusedColwiseParallel", "HeadParallelAttention", "Conv1DParallel", "LocalSplitSize", "heads_replicated",
           "strided_shard",
           "is_strided",
           "SEQUENCE", "scatter_sequence", "gather_sequence", "sequence_block"]

#: The placement of an activation split along the sequence (dimension 1 of `[batch, seq, ...]`).
SEQUENCE = Shard(1)


class _ScatterSequence(PrepareModuleOutput):
    """`PrepareModuleOutput` Replicate -> Shard(1) of a module with one output, the shard a copy of its own (not
    the view `to_local` gives: FSDP2 warns of a block returning a view)."""

    def _prepare_out_fn(self, outputs, device_mesh):
        return super()._prepare_out_fn(outputs, device_mesh).clone(memory_format=torch.contiguous_format)


def scatter_sequence() -> PrepareModuleOutput:
    """Where a sequence-parallel region starts (on the embedding's last submodule, one output): its replicated
    output cut to this rank's sequence shard, sent on as a local tensor (backward: all-gather of the gradient)."""
    return _ScatterSequence(output_layouts=Replicate(), desired_output_layouts=SEQUENCE, use_local_output=True)


def gather_sequence() -> PrepareModuleInput:
    """Where a sequence-parallel region ends (on the head's first submodule): the local sequence shard
    all-gathered into the whole sequence, a local tensor (backward: this rank's slice of the gradient)."""
    return PrepareModuleInput(input_layouts=SEQUENCE, desired_input_layouts=Replicate(), use_local_output=True)

class _FirstInput(PrepareModuleInput):
    """`PrepareModuleInput` of the first positional input only; the others (positions) pass as they are."""

    def _prepare_input_fn(self, inputs, device_mesh):
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        return (*super()._prepare_input_fn(inputs[:1], device_mesh), *inputs[1:])


class _FirstOutput(PrepareModuleOutput):
    """`PrepareModuleOutput` of the first output only; the others (positions) pass as they are."""

    def _prepare_out_fn(self, outputs, device_mesh):
        if not isinstance(outputs, tuple):
            return super()._prepare_out_fn(outputs, device_mesh)
        return (super()._prepare_out_fn(outputs[:1], device_mesh), *outputs[1:])


class _SequenceBlock(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _FirstInput(input_layouts=(SEQUENCE,), desired_input_layouts=(SEQUENCE,))._apply(module, device_mesh)
        _FirstOutput(output_layouts=(SEQUENCE,), desired_output_layouts=(SEQUENCE,),
                     use_local_output=True)._apply(module, device_mesh)
        return module


def sequence_block() -> ParallelStyle:
    """A block whose residual stream is this rank's sequence shard: its first input (the local shard
    `[batch, seq / tp, ...]`) taken as a DTensor of the whole sequence, its first output sent back as the local
    shard; the inputs and outputs after them (the per-token positions of a cut sequence under context parallelism,
    integers crossing whole) pass unchanged."""
    return _SequenceBlock()


def heads_replicated() -> ParallelStyle:
    """A module applied to this rank's attention heads (dimension 2 of `[batch, seq, heads, head_dim]`) with one
    whole weight, such as Qwen3's q/k norms: the weight a replicated DTensor and the input this rank's shard of
    the heads, so the weight's gradient (a partial sum over this rank's heads) is summed over the TP ranks; a
    plain local tensor out. torch's `SequenceParallel` does exactly that with the heads for the sequence."""
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def _distribute_rows(module: nn.Module, names: tuple[str, ...], mesh: DeviceMesh, parts: int,
                     src_data_rank: int | None) -> None:
    """Weights split by strided rows; a bias (1-D) replicated: FSDP2 shards dim 0 of a 1-D tensor, which would
    compose wrongly with the strided split (its add to the strided output only slices it locally)."""
    for name in names:
        param = module.get_parameter(name)
        placement = strided_shard(parts) if param.ndim > 1 else Replicate()
        dist = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class FusedColwiseParallel(ColwiseParallel):
    """`ColwiseParallel` for an `nn.Linear` whose output is `parts` stacked projections (e.g. q, k, v): each rank
    computes its columns of every part; the output is the local `[..., parts * out / tp]` tensor (part-major)."""

    def __init__(self, parts: int, *, input_layouts: Placement | None = None) -> None:
        super().__init__(input_layouts=input_layouts, use_local_output=True)
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute_rows(module, tuple(n for n, _ in module.named_parameters()), device_mesh, self.parts,
                         self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError("FusedColwiseParallel supports nn.Linear only")
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            lambda mod, outputs, mesh: outputs.to_local(),
        )


class HeadParallelAttention(ParallelStyle):
    """`nn.MultiheadAttention` (self-attention, batch first, no masks) split by heads over the mesh: the packed
    `in_proj` is distributed like `FusedColwiseParallel(3)`, `out_proj` is row-parallel; the module's forward
    is replaced by one that attends over this rank's heads and returns the all-reduced (replicated) output.
    With `sequence_parallel`, the query is this rank's sequence shard (all-gathered before the projection) and
    the output is reduce-scattered back to it."""

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.MultiheadAttention) or module.in_proj_weight is None or not module.batch_first:
            raise ConfigError(f"HeadParallelAttention splits a batch-first nn.MultiheadAttention with one packed "
                              f"in_proj, got {type(module).__name__}", hint="use a plan of Colwise/RowwiseParallel")
        tp = device_mesh.size()
        if module.num_heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {module.num_heads} attention heads",
                              hint=f"pass --tp among the divisors of {module.num_heads}")
        _distribute_rows(module, ("in_proj_weight", "in_proj_bias"), device_mesh, 3, self.src_data_rank)
        out_layout = SEQUENCE if self.sequence_parallel else Replicate()
        parallelize_module(module.out_proj, device_mesh, RowwiseParallel(output_layouts=out_layout))
        module.forward = MethodType(partial(_head_parallel_forward, mesh=device_mesh,
                                            sequence_parallel=self.sequence_parallel), module)
        return module


def _head_parallel_forward(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                           need_weights: bool = True, attn_mask: torch.Tensor | None = None,
                           average_attn_weights: bool = True, is_causal: bool = False, *,
                           mesh: DeviceMesh, sequence_parallel: bool = False) -> tuple[torch.Tensor, None]:
    if key is not query or value is not query or key_padding_mask is not None or attn_mask is not None:
        raise ConfigError("the tensor-parallel attention takes self-attention without masks",
                          hint="run this model with --tp 1")
    head_dim = self.embed_dim // self.num_heads
    if sequence_parallel:  # the shard all-gathered (backward: reduce-scatter)
        replicated = DTensor.from_local(query, mesh, [SEQUENCE], run_check=False).redistribute(mesh, [Replicate()])
    else:  # backward: all-reduce
        replicated = DTensor.from_local(query, mesh, [Replicate()], run_check=False)
    qkv = F.linear(replicated, self.in_proj_weight, self.in_proj_bias).to_local()
    batch, length, _ = qkv.shape
    q, k, v = qkv.view(batch, length, 3, -1, head_dim).transpose(1, 3).unbind(2)  # [batch, heads, length, dim]
    attended = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                              is_causal=is_causal, scale=1.0 / math.sqrt(head_dim))
    return self.out_proj(attended.transpose(1, 2).reshape(batch, length, -1)), None


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
        return strided_shard(self.parts, dim=1) if name == "weight" else Replicate()

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
