"""PEFT's LoRA adapters of fused experts, split with the experts over the expert-parallel ranks.

PEFT adapts a 3-D experts parameter (`target_parameters`: `experts.gate_up_proj`, `experts.down_proj`) by wrapping
the experts module in a `ParamWrapper` (one per parameter, nested: `experts.base_layer.base_layer` is the experts
module) whose forward adds `scaling x B_e A_e` to each expert's weight for the call. Its factors hold every expert:
`lora_A` [rank x E, in] with the expert outermost (rows e·rank ... (e+1)·rank - 1 are expert e's), `lora_B`
[out, rank x E] with the expert innermost (columns j·E + e). `split_adapters` keeps this rank's experts of each
factor in the same layout (PEFT's forward runs unchanged on E/ep experts) and marks them as expert parameters
(`parallel.experts.mark_expert`: A along dim 0, B along dim 1 in `rank` blocks), so that their gradients are
reduced over the expert-data-parallel group only and a checkpoint writes them as the whole tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.parallel.experts import mark_expert

__all__ = ["is_param_wrapper", "adapter_wrappers", "split_adapters"]


def is_param_wrapper(module: nn.Module) -> bool:
    """Whether `module` is PEFT's LoRA wrapper of one parameter of the module it wraps (`base_layer`)."""
    return (isinstance(getattr(module, "base_layer", None), nn.Module) and isinstance(getattr(module, "lora_A", None),
                                                                                      nn.ModuleDict)
            and isinstance(getattr(module, "parameter_name", None), str))


def adapter_wrappers(block: nn.Module, experts_name: str) -> list[nn.Module]:
    """PEFT's wrappers around the experts module named `experts_name` in `block` (`...experts.base_layer.base_layer`),
    outermost first; empty when its parameters carry no adapter."""
    wrappers, parts = [], experts_name.split(".")
    while parts and parts[-1] == "base_layer":
        parts.pop()
        wrapper = block.get_submodule(".".join(parts))
        if not is_param_wrapper(wrapper):
            break
        wrappers.insert(0, wrapper)
    return wrappers


def _replace(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    linear.out_features, linear.in_features = weight.shape


def split_adapters(wrapper: nn.Module, first: int, local: int) -> None:
    """Keep experts [first, first + local) of each adapter of PEFT's `wrapper` (its `num_experts` become `local`),
    the new factors marked as expert parameters (see the module's docstring)."""
    total = wrapper.num_experts
    for name in list(wrapper.lora_A):
        a, b = wrapper.lora_A[name].weight.detach(), wrapper.lora_B[name].weight.detach()
        rank = a.shape[0] // total
        _replace(wrapper.lora_A[name], a[first * rank:(first + local) * rank].clone())
        columns = b.reshape(b.shape[0], rank, total)[:, :, first:first + local]
        _replace(wrapper.lora_B[name], columns.reshape(b.shape[0], rank * local).clone())
        mark_expert(wrapper.lora_A[name].weight)
        mark_expert(wrapper.lora_B[name].weight, dim=1, parts=rank)
    wrapper.num_experts = local
