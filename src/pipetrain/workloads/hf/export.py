"""Export back to Hugging Face: a checkpoint of an `HFCausalLM` as a folder `from_pretrained` loads, with its tokenizer.

The checkpoint's layout-free weights (`<block>.<name in block>`, read in one process as `export_checkpoint`
does) are renamed to the transformers model's own names (`HFCausalLM.parameter_keys`), loaded into the
transformers model built from the same config, and written with `save_pretrained` (safetensors): a tied
model is written tied (the embedding once). The tokenizer files of the source folder, when it has a
tokenizer, are written next to it, so `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load the fine-tuned model as it was trained.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipetrain.checkpoint.export import read_weights
from pipetrain.errors import CheckpointError, ConfigError
from pipetrain.workloads.hf.causal_lm import HFCausalLM, require_transformers

__all__ = ["export_hf", "hf_state_dict", "write_folder", "check_new_folder"]


def hf_state_dict(weights: dict[str, torch.Tensor], model: HFCausalLM) -> dict[str, torch.Tensor]:
    """Layout-free block weights -> the transformers model's state dict names (a tied head left out)."""
    state = {}
    for index in range(model.num_blocks):
        for local, key in model.parameter_keys(index).items():
            if model.tied and key == "lm_head.weight":
                continue  # the embedding, which transformers ties to the head on load
            state[key] = weights[f"{index}.{local}"]
    return state


def export_hf(checkpoint: str | Path, model: Any, out: str | Path, *,
              tokenizer_from: str | Path | None = None) -> Path:
    """Write the weights of `checkpoint` as a Hugging Face folder `out` (config, safetensors, tokenizer of
    `tokenizer_from` when given). No process group is needed; the folder appears complete or not at all."""
    transformers = require_transformers()
    check_new_folder(Path(out))
    weights = read_weights(checkpoint, model)
    config = model.config
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    state = hf_state_dict(weights, model)
    expected = set(reference.state_dict()) - ({"lm_head.weight"} if model.tied else set())
    missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unknown:
        raise CheckpointError(f"the checkpoint's weights do not map onto a {config.model_type} model: missing "
                              f"{missing[:3]}, unknown {unknown[:3]}",
                              hint="export with the --model folder (or preset) that trained the checkpoint")
    hf_model = transformers.AutoModelForCausalLM.from_config(config)
    hf_model.load_state_dict(state, strict=not model.tied)
    if model.tied:
        hf_model.tie_weights()
    return write_folder(hf_model, out, tokenizer_from=tokenizer_from)


def check_new_folder(out: Path) -> None:
    """Refuse an export folder that exists and is not empty."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"export folder {str(out)!r} already exists and is not empty",
                          hint="pass a new folder (or an empty one) for the Hugging Face model")


def write_folder(saved: Any, out: str | Path, *, tokenizer_from: str | Path | None = None) -> Path:
    """`saved.save_pretrained` (a transformers or PEFT model) into `out`, with the tokenizer of `tokenizer_from`
    when given; the folder appears complete or not at all."""
    transformers = require_transformers()
    out = Path(out)
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        saved.save_pretrained(partial)
        if tokenizer_from is not None:
            transformers.AutoTokenizer.from_pretrained(str(tokenizer_from), local_files_only=True).save_pretrained(partial)
            generation = Path(tokenizer_from) / "generation_config.json"
            if generation.is_file():
                shutil.copy(generation, partial / generation.name)
        if out.exists():
            out.rmdir()
        partial.replace(out)
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"cannot write {str(out)!r}: {err.strerror or err}",
                              hint="pass a folder you can write to") from None
    return out
