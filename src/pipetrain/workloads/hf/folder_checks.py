"""Before any rank loads a block: a checkpoint folder's config.json and tensors checked against the configured model,
each disagreement one ConfigError naming the field or tensor and the sizes the config gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipetrain.errors import ConfigError

__all__ = ["check_folder_config", "check_weights"]

#: the config fields a disagreement message names (those the config has)
_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "n_embd", "n_inner", "n_head")


def check_folder_config(config: Any, folder: Path) -> None:
    """A ConfigError when `folder`'s config.json describes another model than `config` (its type or sizes)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return  # shapes are still checked tensor by tensor when loading
    theirs = json.loads(config_file.read_text())
    ours = config.to_dict()
    for field in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "n_embd", "n_layer"):
        if field in theirs and field in ours and theirs[field] != ours[field]:
            raise ConfigError(
                f"checkpoint folder {str(folder)!r} holds another model: its {field} is {theirs[field]!r}, "
                f"the configured model's is {ours[field]!r}",
                hint="pass the folder of this model, or build the model from that folder (HFCausalLM.from_folder)",
            )


def check_weights(model: Any) -> None:
    """One ConfigError for the first tensor the config of `model` (an `HFCausalLM` with a checkpoint folder) needs
    that the folder lacks or holds in another shape (a config.json that does not describe its weights), before any
    rank loads a block."""
    stored, folder = model.checkpoint.shapes(), str(model.checkpoint.folder)
    for index in range(model.num_blocks):
        with torch.device("meta"):
            block = model.build_block(index)
        state = block.state_dict()
        for name, key in block.checkpoint_keys():
            found = model.checkpoint.find(key, model.family.base)
            if found is None and key == f"{model.family.head}.weight" and model.tied:
                found = model.checkpoint.find(f"{model.family.embed}.weight", model.family.base)
            sizes = ", ".join(f"{field}={getattr(model.config, field)}" for field in _SIZE_FIELDS
                              if isinstance(getattr(model.config, field, None), int))
            if found is None:
                raise ConfigError(f"checkpoint folder {folder!r} has no tensor {key!r}, which its config "
                                  f"({model.family.name}: {sizes}) needs: the config and the weights disagree",
                                  hint=f"pass a folder whose config.json was saved with its weights "
                                       f"(save_pretrained), or fix config.json (e.g. its model_type, "
                                       f"{model.config.model_type!r})")
            if list(stored[found]) != list(state[name].shape):
                raise ConfigError(f"checkpoint folder {folder!r}: tensor {found!r} has shape "
                                  f"{list(stored[found])}, its config ({model.family.name}: {sizes}) needs "
                                  f"{list(state[name].shape)}: the config and the weights disagree",
                                  hint="pass a folder whose config.json was saved with its weights "
                                       "(save_pretrained), or fix the sizes in config.json")
