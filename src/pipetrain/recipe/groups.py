"""AdamW with two parameter groups: weight decay on matrices, none on biases, norm weights and embeddings.

The rule looks at each parameter alone, so every stage, replica and shard sorts its parameters the same way
under any layout: a parameter decays iff it has 2 or more dimensions and is not owned by an `nn.Embedding`.
An FSDP2 parameter is a DTensor whose `ndim` is that of the whole tensor, so a shard is sorted as the
unsharded parameter is; DDP wraps the parameters themselves. A copy of a tied weight (an output head tied
to the input embedding, see `pipetrain.pipeline.tied`) is sorted as its canonical copy, so the copies update alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pipetrain.pipeline import PipelineEngine
from pipetrain.recipe.config import RecipeConfig

__all__ = ["decays", "param_groups", "no_decay_names", "build_optimizer"]

Source = PipelineEngine | nn.Module


def _named(source: Source) -> Iterator[tuple[str, nn.Parameter]]:
    """Each parameter once, by its layout-free name (an engine's `<block>.<name>`, a module's own names)."""
    seen: set[int] = set()
    for name, param in source.named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            yield name, param


def _embedding_ids(source: Source) -> set[int]:
    modules: Iterable[nn.Module] = source.modules if isinstance(source, PipelineEngine) else [source]
    ids = {id(p) for module in modules for sub in module.modules() if isinstance(sub, nn.Embedding)
           for p in sub.parameters(recurse=False)}
    if isinstance(source, PipelineEngine):  # a head tied to the embedding is sorted as the embedding is
        ids |= source.tied.embedding_ids(source.model)
    return ids


def decays(param: torch.Tensor, *, embedding: bool) -> bool:
    """Whether weight decay applies to `param` (a matrix or larger that is not an embedding table)."""
    return param.ndim >= 2 and not embedding


def no_decay_names(source: Source) -> set[str]:
    """The names of the trained parameters that get no weight decay (engine: layout-free `<block>.<name>`)."""
    embeddings = _embedding_ids(source)
    return {name for name, p in _named(source) if p.requires_grad and not decays(p, embedding=id(p) in embeddings)}


def param_groups(source: Source, weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups of an engine's (or a module's) parameters: the decaying ones with
    `weight_decay`, the others with 0. An empty group is left out (a stage may hold no matrix); frozen parameters
    (LoRA's base) are in none; a rank with nothing to train gets one empty group (an optimizer that does nothing)."""
    embeddings = _embedding_ids(source)
    decay: list[nn.Parameter] = []
    other: list[nn.Parameter] = []
    for _, param in _named(source):
        if not param.requires_grad:  # frozen (LoRA's base): no gradient, no optimizer state
            continue
        (decay if decays(param, embedding=id(param) in embeddings) else other).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    kept = [group for group in groups if group["params"]]
    return kept or [{"params": [], "weight_decay": 0.0}]  # a stage with nothing to train: an empty optimizer


def build_optimizer(source: Source, lr: float, weight_decay: float = RecipeConfig.weight_decay,
                    **adamw: Any) -> torch.optim.AdamW:
    """AdamW at `lr` over `param_groups(source, weight_decay)`; `adamw` are its other arguments (betas, eps, ...)."""
    return torch.optim.AdamW(param_groups(source, weight_decay), lr=lr, **adamw)
