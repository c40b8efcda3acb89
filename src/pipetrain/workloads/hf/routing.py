"""A Hugging Face MoE layer block's router plumbing: how many experts, whether the load-balancing loss is on, the
router's output hook (logits, chosen experts, the slots an expert capacity drops) and shape inference on meta."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipetrain.moe.capacity import within_capacity
from pipetrain.workloads.hf.families import Family

__all__ = ["num_experts", "carries_router_statistics", "RouterOutputs", "shapes_only"]


def num_experts(config: Any, family: Family) -> int:
    """The routed experts of each MoE layer (0: a dense family)."""
    return int(getattr(config, family.experts)) if family.experts else 0


def carries_router_statistics(config: Any, family: Family) -> bool:
    """Whether the load-balancing loss is on: a MoE family whose transformers causal LM adds it, with
    `config.output_router_logits` (as transformers' forward decides) and a non-zero `router_aux_loss_coef`."""
    return bool(family.experts and family.aux_loss and getattr(config, "output_router_logits", False)
                and getattr(config, "router_aux_loss_coef", 0.0))


class RouterOutputs(list):
    """A router's forward hook keeping (logits, chosen experts, dropped slots or None) of each call (an object, not
    a closure: a deep copy of the block, as `pipetrain check` makes, hooks its own copy). With a `capacity`, the
    router's output (logits, top-k weights, top-k experts) is returned with the weights of the slots beyond each
    expert's capacity zeroed (`pipetrain.moe.capacity.within_capacity`)."""

    at = 0  #: the index of the logits in the router's output
    capacity: float | None = None  #: the expert capacity factor (None: nothing dropped)
    experts = 0  #: the layer's routed experts
    #: context parallelism's `ContextParallel` (None without): the slots are served over the whole sequences
    context: Any = None
    batch = 1  #: the micro-batch's sequences (set by the layer before each forward; read under context parallelism)

    def __call__(self, module: nn.Module, args: Any, out: tuple[torch.Tensor, ...]) -> Any:
        chosen = out[-1]
        if self.capacity is None or chosen.device.type == "meta":
            self.append((out[self.at], chosen, None))
            return None
        keep = self._keep(chosen)
        self.append((out[self.at], chosen, (~keep).sum()))
        return (*out[:-2], out[-2] * keep.to(out[-2].dtype), chosen)

    def _keep(self, chosen: torch.Tensor) -> torch.Tensor:
        """Which of this rank's slots `chosen` [N, k] the capacity keeps: of the micro-batch's whole sequences under
        context parallelism (the cp ranks' choices gathered, served in token order, this rank's part kept), so
        the slots dropped are the unsplit model's."""
        if self.context is None:
            return within_capacity(chosen, self.experts, self.capacity)
        local = chosen.view(self.batch, -1, chosen.shape[-1])
        whole = self.context.whole_sequences(local)
        keep = within_capacity(whole.reshape(-1, chosen.shape[-1]), self.experts, self.capacity)
        return self.context.own_part(keep.view(whole.shape)).reshape(chosen.shape)


@contextmanager
def shapes_only(experts: list[nn.Module]) -> Iterator[None]:
    """On the meta device (shape inference): each experts module returns zeros of its input's shape, which is its
    output's (transformers' expert kernels group tokens by the router's choice, values the meta device has not)."""
    for module in experts:
        module.forward = lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)
    try:
        yield
    finally:
        for module in experts:
            del module.forward
