"""Switching a stage's LoRA adapters off for a while: the frozen base alone computes (a reference model for DPO
and GRPO with no second copy of the weights)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn

__all__ = ["adapters_disabled"]


@contextmanager
def adapters_disabled(modules: Iterable[nn.Module]) -> Iterator[int]:
    """Within the block, PEFT's LoRA layers of `modules` (and their submodules) pass their base layer's output
    alone (`BaseTunerLayer.enable_adapters(False)`); yields how many layers were switched off (0: no adapters, the
    modules compute as they are). Switched back on when it ends, even after an error."""
    layers = [m for module in modules for m in module.modules()
              if callable(getattr(m, "enable_adapters", None)) and hasattr(m, "lora_A")]
    on = [not getattr(layer, "disable_adapters", False) for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield len(layers)
    finally:
        for layer, was in zip(layers, on):
            layer.enable_adapters(was)
