"""Layout-free names: a rank's model and optimizer state keyed as in the unsplit model, whatever the layout."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pipetrain.blocks import BlockModel
from pipetrain.partition import balance_bounds

__all__ = ["StageNames", "fingerprint"]


class StageNames:
    """Renames the keys of `torch.distributed.checkpoint.state_dict` helpers for an engine's stage modules.

    The helpers are called on `nn.ModuleList(engine.modules)`, whose keys read `<slot>.<wrapper path>.<local
    block>.<name in block>` (DDP/FSDP prefixes already removed). The layout-free key is `<block>.<name in
    block>` with the block index of the unsplit model (as `engine.named_parameters()` names parameters), so
    the same checkpoint loads under any pp, dp, dp-mode, schedule, virtual stages or balance. `aliases` maps
    the name of each copy of a tied weight to its canonical name (`pipetrain.pipeline.tied.tied_aliases`):
    every copy is stored and loaded under that one key, so a checkpoint holds a tied weight once.
    """

    def __init__(self, stage_ids: list[int], balance: tuple[int, ...] | list[int],
                 aliases: Mapping[str, str] | None = None) -> None:
        bounds = balance_bounds(balance)
        self._first_block = [bounds[stage_id][0] for stage_id in stage_ids]
        self._aliases = dict(aliases or {})
        self._to_local: dict[str, list[str]] = {}

    def free(self, local: str) -> str:
        """The layout-free name of a container key `local` (remembered, for `local_name`)."""
        slot, _, path = local.partition(".")
        parts = path.split(".")
        position = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if not slot.isdigit() or position is None:
            raise ValueError(f"unexpected stage state key {local!r}")
        block = self._first_block[int(slot)] + int(parts[position])
        name = ".".join([str(block), *parts[position + 1 :]])
        name = self._aliases.get(name, name)
        locals_ = self._to_local.setdefault(name, [])
        if local not in locals_:
            locals_.append(local)
        return name

    def local(self, free: str) -> str:
        """The container key of a layout-free name seen by `free` on this rank (the first, for a tied weight)."""
        return self._to_local[free][0]

    def locals(self, free: str) -> list[str]:
        """Every container key of a layout-free name seen by `free` (several for copies of a tied weight)."""
        return self._to_local[free]

    def model_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Model state dict with layout-free keys."""
        return {self.free(key): value for key, value in state.items()}

    def optimizer_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Flattened optimizer state dict (`state.<fqn>.<what>`, `param_groups.<fqn>.<what>`), layout-free."""
        return _rename_optimizer_keys(state, self.free)

    def local_model_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {local: value for key, value in state.items() for local in self.locals(key)}

    def local_optimizer_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        renamed = {}
        for key, value in state.items():
            head, _, body = key.partition(".")
            fqn, _, what = body.rpartition(".")
            renamed.update({f"{head}.{local}.{what}": value for local in self.locals(fqn)})
        return renamed


def _rename_optimizer_keys(state: Mapping[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """A flattened optimizer state dict with the parameter name inside each `<head>.<fqn>.<what>` key renamed."""
    renamed = {}
    for key, value in state.items():
        head, _, body = key.partition(".")
        fqn, _, what = body.rpartition(".")
        renamed[f"{head}.{rename(fqn)}.{what}"] = value
    return renamed


def fingerprint(model: BlockModel) -> str:
    """sha256 of each block's class name and parameter/buffer names, shapes and dtypes (built on meta)."""
    digest = hashlib.sha256()
    for index in range(model.num_blocks):
        with torch.device("meta"):
            block: nn.Module = model.build_block(index)
        digest.update(f"{index}:{type(block).__name__}\n".encode())
        for name, tensor in block.state_dict().items():
            digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\n".encode())
    return digest.hexdigest()
