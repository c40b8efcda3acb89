"""The experts of one MoE layer split over an expert-parallel group: transformers' fused experts module, a slice.

transformers 5 keeps a layer's experts fused (`Qwen3MoeExperts`, `MixtralExperts`, `OlmoeExperts`, ...: `gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I], `forward(hidden, top_k_index, top_k_weights)`). `ExpertParallelExperts` takes
such a module and keeps experts [r·E/ep, (r+1)·E/ep) of rank r of the group; its forward has the same signature and
the same result: the tokens are dispatched to the experts' ranks, run through the local experts and combined back
(`pipetrain.moe.dispatch`). The local experts run as two grouped matmuls (`compat.grouped.grouped_mm`) where the
kernel's shape rules allow, else as a loop over the local experts (`grouped=False` forces the loop).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipetrain.compat.grouped import grouped_mm, grouped_mm_fits
from pipetrain.errors import ConfigError
from pipetrain.moe.dispatch import combine, dispatch

__all__ = ["ExpertParallelExperts", "is_fused_experts", "run_experts"]


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module of the fused gated layout this module splits (3-D
    `gate_up_proj` and `down_proj`, gate and up concatenated, no biases, not transposed)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and not getattr(module, "has_bias", False)
            and not getattr(module, "is_transposed", False) and getattr(module, "has_gate", True)
            and getattr(module, "is_concatenated", True) and hasattr(module, "act_fn"))


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def run_experts(tokens: torch.Tensor, counts: list[int], gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                act_fn, *, grouped: bool | None = None) -> torch.Tensor:
    """Each block of `tokens` [R, H] (`counts[e]` rows for local expert e, in order) through its gated expert:
    `down_e(act(gate_e(x)) * up_e(x))`. `grouped`: True two grouped matmuls, False a loop over the experts, None
    grouped where `grouped_mm_fits`. Under autocast the grouped matmuls run in the autocast dtype, as `F.linear`."""
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


class ExpertParallelExperts(nn.Module):
    """The local slice of a transformers fused experts module, run over the expert-parallel `group` (None or one
    rank: every expert local, no communication; `backward_group`, when given, the same ranks' second group, for the
    exchanges of backward passes: `moe.dispatch`). `gate_up_proj` and `down_proj` keep their names, with E/ep rows;
    `first_expert` is the layer's index of the first local expert."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup | None, *, grouped: bool | None = None,
                 backward_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not is_fused_experts(experts):
            raise ConfigError(f"expert parallelism splits transformers' fused gated experts (gate_up_proj [E, 2I, H], "
                              f"down_proj [E, H, I]); {type(experts).__name__} has another layout",
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
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[local].clone(),
                                         requires_grad=experts.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[local].clone(),
                                      requires_grad=experts.down_proj.requires_grad)
        self.act_fn = experts.act_fn

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts}, "
                f"grouped={self.grouped}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts forward: `hidden_states` [N, H], each token's experts and router weights [N, k]."""
        sent = dispatch(hidden_states, top_k_index, self.num_experts, self.group, self.backward_group)
        out = run_experts(sent.tokens, sent.counts_list, self.gate_up_proj, self.down_proj, self.act_fn,
                          grouped=self.grouped)
        return combine(out, sent, top_k_weights).to(hidden_states.dtype)
