"""A safetensors checkpoint folder read through transformers' own checkpoint conversion, one tensor at a time.

transformers 5 keeps some weights in memory in another layout than on disk: a mixture-of-experts layer's experts are
fused (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) but written per expert
(`mlp.experts.0.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.0.w1.weight`), and `from_pretrained` converts
on load with the model's conversion mapping (`conversion_mapping.get_model_conversion_mapping`: renamings, and
weight converters such as `MergeModulelist` + `Concatenate`). `HFCheckpoint` takes the same mapping from the model
class built on the meta device, renames every stored key as `from_pretrained` does (`core_model_loading.
rename_source_key`, base-model prefix added or dropped), and groups the stored keys by the in-memory name they
become. `tensor(name)` then reads only that name's stored tensors (a rank reads only the layers and experts it
holds) and runs the converter's own operations on them; `shapes()` runs them on meta tensors of the headers' shapes
(nothing read). A folder whose keys already are the in-memory names (every dense family's) reads as before.
"""

from __future__ import annotations

import copy
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from pipetrain.errors import ConfigError
from pipetrain.workloads.hf.families import require_transformers

__all__ = ["HFCheckpoint"]

#: the expert index in a per-expert stored key (`mlp.experts.3.gate_proj.weight`, `block_sparse_moe.experts.3.w1.weight`)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class HFCheckpoint:
    """The tensors of a local safetensors folder (one file or a sharded index) under the names of the transformers
    model of `config` (its in-memory names: converted as `from_pretrained` converts them)."""

    def __init__(self, folder: Path, config: Any | None = None) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.files = {key: folder / name for key, name in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(folder / "model.safetensors", framework="pt") as f:
                self.files = {key: folder / "model.safetensors" for key in f.keys()}
        else:
            raise ConfigError(
                f"checkpoint folder {str(folder)!r} has no model.safetensors nor model.safetensors.index.json",
                hint="pass a folder written by save_pretrained(..., safe_serialization=True)",
            )
        #: in-memory name -> [(stored key, the converter's source pattern, or None for a plain rename)]
        self.sources: dict[str, list[tuple[str, str | None]]] = {key: [(key, None)] for key in self.files}
        self._converters: dict[str, Any] = {}
        if config is not None:
            self._convert_names(config)

    def _convert_names(self, config: Any) -> None:
        """Group the stored keys by the in-memory name `from_pretrained` gives them (its conversion mapping)."""
        transformers = require_transformers()
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        logging_ = transformers.utils.logging
        verbosity = logging_.get_verbosity()
        logging_.set_verbosity_error()
        try:
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
        finally:
            logging_.set_verbosity(verbosity)
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._converters = {pattern: c for c in converters for pattern in c.source_patterns}
        meta_state = model.state_dict()
        sources: dict[str, list[tuple[str, str | None]]] = defaultdict(list)
        for key in sorted(self.files, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
            if name not in meta_state and key in meta_state:  # as from_pretrained: a stored in-memory name stays
                name, pattern = key, None
            sources[name].append((key, pattern))
        self.sources = dict(sources)

    def find(self, key: str, base: str) -> str | None:
        """The name `key` is held under (a checkpoint of the base model, as GPT-2's original files, omits `base`)."""
        if key in self.sources:
            return key
        bare = key.removeprefix(f"{base}.")
        return bare if bare != key and bare in self.sources else None

    def read(self, key: str) -> torch.Tensor:
        """The stored tensor `key` as it is on disk."""
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            return f.get_tensor(key)

    def tensor(self, name: str, experts: range | None = None) -> torch.Tensor:
        """The in-memory tensor `name` (from `find`): its stored tensors read and converted as transformers does.
        `experts`: only these rows of a fused experts tensor ([E, ...]); stored per expert, only theirs are read."""
        if experts is None:
            return self._convert(name, self.read)
        picked = [(key, pattern) for key, pattern in self.sources[name]
                  if (found := _EXPERT.search(key)) is not None and int(found.group(1)) in experts]
        if not picked:  # stored fused (or not per expert): read whole, keep the rows
            return self._convert(name, self.read)[experts.start:experts.stop]
        return self._convert(name, self.read, picked)

    def per_expert(self, name: str) -> bool:
        """Whether `name` is stored as one tensor per expert (a fused experts tensor transformers merges on load)."""
        return any(pattern is not None and _EXPERT.search(key) for key, pattern in self.sources[name])

    def shapes(self) -> dict[str, list[int]]:
        """Every in-memory tensor's shape, from the safetensors headers (no tensor is read; conversions run on meta)."""
        stored: dict[str, list[int]] = {}
        for file in sorted(set(self.files.values())):
            with open(file, "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            stored.update({key: entry["shape"] for key, entry in header.items() if key != "__metadata__"})
        return {name: list(self._convert(name, lambda key: torch.empty(stored[key], device="meta")).shape)
                for name in self.sources}

    def _convert(self, name: str, read: Any, sources: list[tuple[str, str | None]] | None = None) -> torch.Tensor:
        sources = self.sources[name] if sources is None else sources
        pattern = sources[0][1]
        if pattern is None:
            return read(sources[0][0])
        converter = copy.deepcopy(self._converters[pattern])
        for key, source_pattern in sources:
            converter.add_tensor(name, key, source_pattern, lambda key=key: read(key))
        return converter.convert(name)[name]
