"""Export of a LoRA checkpoint: a PEFT adapter folder (`--peft`), or the merged model as a transformers folder
(`--hf --merge`).

Both read the checkpoint in one process (`read_weights`: the adapters from the checkpoint, the base from the model's
own folder, checked to be the one the adapters were trained on), rename the weights to the transformers model's
names (`hf_state_dict`: PEFT's layers keep transformers' paths, `q_proj.base_layer.weight`,
`q_proj.lora_A.default.weight`) and load them into `peft.get_peft_model(transformers model, the run's LoraConfig)`.
`--peft` writes it with PEFT's own `save_pretrained` (adapter_config.json naming the base folder,
adapter_model.safetensors with PEFT's key names), which `PeftModel.from_pretrained(base, OUT)` loads; `--merge` folds
each adapter into its base weight with PEFT's `merge_and_unload` and writes the plain transformers model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipetrain.checkpoint.export import read_weights
from pipetrain.errors import CheckpointError, ConfigError
from pipetrain.lora.config import require_peft
from pipetrain.lora.model import LoraBlocks
from pipetrain.workloads.hf.export import check_new_folder, hf_state_dict, write_folder
from pipetrain.workloads.hf.families import require_transformers

__all__ = ["export_peft", "export_merged", "peft_model", "has_tokenizer"]

_PEFT_PREFIX = "base_model.model."


def has_tokenizer(folder: str | Path | None) -> bool:
    """Whether `folder` holds tokenizer files (a folder made by `save_pretrained` of a model alone has none)."""
    return folder is not None and any((Path(folder) / name).is_file()
                                      for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def peft_model(checkpoint: str | Path, model: LoraBlocks) -> Any:
    """The transformers model of `model.config` with PEFT's LoRA layers, holding the checkpoint's adapters and the
    base weights (a `PeftModel`, in eval mode)."""
    transformers, peft = require_transformers(), require_peft()
    weights = read_weights(checkpoint, model)
    state = {_PEFT_PREFIX + key: value for key, value in hf_state_dict(weights, model).items()}
    base = transformers.AutoModelForCausalLM.from_config(model.config)
    folder = model.base_identity().get("folder")
    if folder is not None:
        base.config._name_or_path = folder  # adapter_config.json's base_model_name_or_path
    wrapped = peft.get_peft_model(base, model.settings.peft_config(model.targets))
    missing, unknown = wrapped.load_state_dict(state, strict=False)
    missing = [key for key in missing if not (model.tied and key.endswith("lm_head.weight"))]
    if missing or unknown:
        raise CheckpointError(f"the checkpoint's adapters do not map onto a {model.config.model_type} model with "
                              f"PEFT's layers: missing {missing[:3]}, unknown {unknown[:3]}",
                              hint="export with the --model folder that trained the checkpoint")
    if model.tied:
        wrapped.base_model.model.tie_weights()
    return wrapped.eval()


def export_peft(checkpoint: str | Path, model: LoraBlocks, out: str | Path) -> Path:
    """Write the adapters of `checkpoint` as a PEFT adapter folder `out` (see the module's docstring)."""
    folder = model.base_identity().get("folder")
    if folder is None:
        raise ConfigError("--peft writes adapters for a base model folder, but this checkpoint's base was built from "
                          "a preset's config (no folder PeftModel.from_pretrained could load)",
                          hint="export the merged model with --hf --merge, or train with --model DIR")
    check_new_folder(Path(out))
    with torch.no_grad():
        wrapped = peft_model(checkpoint, model)
    return write_folder(wrapped, out, tokenizer_from=folder if has_tokenizer(folder) else None)


def export_merged(checkpoint: str | Path, model: LoraBlocks, out: str | Path, *,
                  tokenizer_from: str | Path | None = None) -> Path:
    """Write the base with the adapters of `checkpoint` merged into it (PEFT's `merge_and_unload`) as a
    transformers folder `out`, with the tokenizer of `tokenizer_from` when it has one."""
    check_new_folder(Path(out))
    with torch.no_grad():
        merged = peft_model(checkpoint, model).merge_and_unload()
    return write_folder(merged, out, tokenizer_from=tokenizer_from if has_tokenizer(tokenizer_from) else None)
