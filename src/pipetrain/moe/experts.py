"""The experts of one MoE layer split over an expert-parallel group: transformers' fused experts module, a slice.

transformers 5 keeps a layer's experts fused (`Qwen3MoeExperts`, `MixtralExperts`, `OlmoeExperts`, ...: `gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I], `forward(hidden, top_k_index, top_k_weights)`). `ExpertParallelExperts` takes
such a module and keeps experts [r·E/ep, (r+1)·E/ep) of rank r of the group; its forward has the same signature and
the same result: the tokens are dispatched to the experts' ranks, run through the local experts and combined back
(`pipetrain.moe.dispatch`). The local experts run as two grouped matmuls (`compat.grouped.grouped_mm`) where the
kernel's shape rules allow, else as a loop over the local experts (`grouped=False` forces the loop).

Other gated layouts (GPT-OSS's `GptOssExperts`: `gate_up_proj` [E, H, 2I] transposed, gate and up interleaved,
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H], a clamped SwiGLU in its `_apply_gate`)
keep every [E, ...] parameter's local rows and run as a loop over the local experts, each as the module computes it.
"""

from __future__ import annotations

import copy
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipetrain.compat.grouped import grouped_mm, grouped_mm_fits
from pipetrain.errors import ConfigError
from pipetrain.moe.dispatch import combine, dispatch

__all__ = ["ExpertParallelExperts", "is_fused_experts", "is_plain_experts", "run_experts"]

#: the biases of a fused experts module with `has_bias` ([E, 2I] and [E, H])
BIASES = ("gate_up_proj_bias", "down_proj_bias")


def _own_gate(module: nn.Module) -> bool:
    """Whether the module's class defines its own `_apply_gate` (GPT-OSS's clamped SwiGLU), not transformers'
    default `act_fn(gate) * up` (a plain function the experts decorator attaches)."""
    gate = getattr(type(module), "_apply_gate", None)
    return gate is not None and "." in getattr(gate, "__qualname__", "")


def is_plain_experts(module: nn.Module) -> bool:
    """Whether `module` has the plain fused gated layout (gate and up concatenated, no biases, not transposed,
    `act_fn(gate) * up`): the layout the grouped matmuls run."""
    return (not getattr(module, "has_bias", False) and not getattr(module, "is_transposed", False)
            and getattr(module, "is_concatenated", True) and hasattr(module, "act_fn") and not _own_gate(module))


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module of a fused gated layout this module splits: 3-D
    `gate_up_proj` and `down_proj` (transposed or not, gate and up concatenated or interleaved), with `has_bias`
    2-D `gate_up_proj_bias` and `down_proj_bias`, every parameter [E, ...], no post-expert norm, and a gate
    (`act_fn`, or the module's own `_apply_gate`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and getattr(module, "has_gate", True)
            and not getattr(module, "has_post_expert_norm", False)):
        return False
    if getattr(module, "has_bias", False) and not all(
            isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 2
            for name in BIASES):
        return False
    if any(p.dim() == 0 or p.shape[0] != gate_up.shape[0] for p in module.parameters()):
        return False
    return is_plain_experts(module) or hasattr(module, "act_fn") or _own_gate(module)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _project(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """`rows` through one expert's projection: `rows @ weight + bias` (`transposed`: weight [in, out], as GPT-OSS
    computes it) or `F.linear` (weight [out, in])."""
    if not transposed:
        return F.linear(rows, weight, bias)
    out = rows @ weight
    return out if bias is None else out + bias


def _run_general(tokens: torch.Tensor, counts: list[int], gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                 gate, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 transposed: bool) -> torch.Tensor:
    outputs, start = [], 0
    for expert, count in enumerate(counts):  # an expert without rows still joins the graph: a zero gradient
        rows = tokens[start:start + count]
        hidden = _project(rows, gate_up_proj[expert], None if gate_up_bias is None else gate_up_bias[expert],
                          transposed)
        outputs.append(_project(gate(hidden), down_proj[expert], None if down_bias is None else down_bias[expert],
                                transposed))
        start += count
    return torch.cat(outputs)


def run_experts(tokens: torch.Tensor, counts: list[int], gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                act_fn, *, grouped: bool | None = None, gate=None, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, transposed: bool = False) -> torch.Tensor:
    """Each block of `tokens` [R, H] (`counts[e]` rows for local expert e, in order) through its gated expert:
    `down_e(act(gate_e(x)) * up_e(x))`. `grouped`: True two grouped matmuls, False a loop over the experts, None
    grouped where `grouped_mm_fits`. Under autocast the grouped matmuls run in the autocast dtype, as `F.linear`.
    Another layout (`gate`: the module's `_apply_gate` on the [R, 2I] projection; the biases [E, ...];
    `transposed` weights [E, in, out]) always runs as the loop, each expert as transformers' module computes it."""
    if gate is not None or gate_up_bias is not None or down_bias is not None or transposed:
        if gate is None:
            def gate(hidden: torch.Tensor) -> torch.Tensor:
                first, up = hidden.chunk(2, dim=-1)
                return act_fn(first) * up
        return _run_general(tokens, counts, gate_up_proj, down_proj, gate, gate_up_bias, down_bias, transposed)
    low = _autocast_dtype(tokens.device)
    if grouped is None:
        probe = tokens.to(low) if low is not None else tokens
        weight = gate_up_proj.to(low) if low is not None else gate_up_proj
        grouped = grouped_mm_fits(probe, weight) and grouped_mm_fits(probe.new_empty(0, down_proj.shape[-1]),
                                                                     down_proj.to(weight.dtype))
    if not grouped:
        outputs, start = [], 0
        for expert, count in enumerate(counts):  # an expert without rows still joins the graph: a zero gradient
            rows = tokens[start:start + count]
            gate, up = F.linear(rows, gate_up_proj[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(act_fn(gate) * up, down_proj[expert]))
            start += count
        return torch.cat(outputs)
    dtype = low or gate_up_proj.dtype
    offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
    hidden = grouped_mm(tokens.to(dtype), gate_up_proj.to(dtype).transpose(-2, -1), offsets)
    gate, up = hidden.chunk(2, dim=-1)
    return grouped_mm((act_fn(gate) * up).contiguous(), down_proj.to(dtype).transpose(-2, -1), offsets)


def _gate_of(experts: nn.Module):
    """The module's own `_apply_gate`, bound to a copy of it without its parameters (its constants only: GPT-OSS's
    alpha and limit), so that the split keeps no whole expert tensor alive."""
    shell = copy.copy(experts)
    shell.__dict__["_parameters"] = {}
    return types.MethodType(type(experts)._apply_gate, shell)


class ExpertParallelExperts(nn.Module):
    """The local slice of a transformers fused experts module, run over the expert-parallel `group` (None or one
    rank: every expert local, no communication; `backward_group`, when given, the same ranks' second group, for the
    exchanges of backward passes: `moe.dispatch`). Every parameter (`gate_up_proj`, `down_proj`, and GPT-OSS's
    biases) keeps its name, with E/ep rows; `first_expert` is the layer's index of the first local expert."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup | None, *, grouped: bool | None = None,
                 backward_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not is_fused_experts(experts):
            raise ConfigError(f"expert parallelism splits transformers' fused gated experts (3-D gate_up_proj and "
                              f"down_proj, optional [E, ...] biases); {type(experts).__name__} has another layout",
                              hint="use --ep 1 for this model")
        ep = 1 if group is None else dist.get_world_size(group)
        total = experts.gate_up_proj.shape[0]
        if total % ep:
            raise ConfigError(f"--ep {ep} does not divide the {total} experts of {type(experts).__name__}",
                              hint=f"pass --ep among the divisors of {total}")
        self.num_experts, self.local_experts, self.group, self.grouped = total, total // ep, group, grouped
        self.backward_group = backward_group  # the same ranks' group for the backward's exchanges (or None)
        self.first_expert = (0 if group is None else dist.get_rank(group)) * self.local_experts
        local = slice(self.first_expert, self.first_expert + self.local_experts)
        for name, param in experts.named_parameters(recurse=False):  # gate_up_proj, down_proj (and biases) first
            setattr(self, name, nn.Parameter(param.detach()[local].clone(), requires_grad=param.requires_grad))
        self.plain = is_plain_experts(experts)
        if hasattr(experts, "act_fn"):
            self.act_fn = experts.act_fn
        self.transposed = bool(getattr(experts, "is_transposed", False))
        self.gate = None if self.plain or not _own_gate(experts) else _gate_of(experts)

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
                f"grouped={self.grouped}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts forward: `hidden_states` [N, H], each token's experts and router weights [N, k]."""
        sent = dispatch(hidden_states, top_k_index, self.num_experts, self.group, self.backward_group)
        if self.plain:
            out = run_experts(sent.tokens, sent.counts_list, self.gate_up_proj, self.down_proj, self.act_fn,
                              grouped=self.grouped)
        else:
            out = run_experts(sent.tokens, sent.counts_list, self.gate_up_proj, self.down_proj,
                              getattr(self, "act_fn", None), gate=self.gate, transposed=self.transposed,
                              gate_up_bias=getattr(self, "gate_up_proj_bias", None),
                              down_bias=getattr(self, "down_proj_bias", None))
        return combine(out, sent, top_k_weights).to(hidden_states.dtype)
