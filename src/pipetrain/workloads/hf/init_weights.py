"""Initialise a Hugging Face block's parameters as transformers' `_init_weights` does (a model built from a config)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pipetrain.workloads.hf.families import Family, require_transformers

__all__ = ["init_like_transformers"]


def init_like_transformers(block: nn.Module, config: Any, family: Family) -> None:
    """transformers' initialisation: normal(0, initializer_range) weights, zero biases, norms at the family's
    `norm_init` (1; Gemma's zero-centred norms 0, as `GemmaPreTrainedModel._init_weights` does); the family's
    `scaled_init` modules (GPT-2's residual projections) with std / sqrt(2 * layers); another module's own matrices
    (fused experts, a router's) and GPT-OSS's sinks normal(0, std), its own biases zero."""
    conv1d = require_transformers().pytorch_utils.Conv1D
    std = config.initializer_range
    with torch.no_grad():
        for name, module in block.named_modules():
            if isinstance(module, (nn.Linear, conv1d, nn.Embedding)):
                scaled = family.scaled_init is not None and name.endswith(family.scaled_init)
                module.weight.normal_(0.0, std / math.sqrt(2 * config.num_hidden_layers) if scaled else std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
                module.weight.fill_(family.norm_init)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            else:  # parameters of their own (a MoE layer's fused experts and router, GPT-OSS's sinks) as
                # transformers' `_init_weights` draws them: matrices and sinks normal(0, std), biases zero
                for name, param in module.named_parameters(recurse=False):
                    if param.dim() >= 2 or name == "sinks":
                        param.normal_(0.0, std)
                    elif name.endswith("bias"):
                        param.zero_()
