"""The model a generation job runs: a `--model DIR` folder, or a `--checkpoint CK` of a fine-tune, whose layout-free
weights each rank reads for its own blocks only (whatever layout wrote it). A LoRA fine-tune's checkpoint holds its
adapters only: the blocks are built from the base folder with PEFT's layers on them (`LoraBlocks`, as in training),
and only the adapters are read from the checkpoint (after checking it was trained on this base)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from pipetrain.checkpoint.folders import read_meta
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.checkpoint.state import check_compatible, find_checkpoint
from pipetrain.errors import CheckpointError, ConfigError
from pipetrain.lora import LoraBlocks, LoraSettings, is_adapter
from pipetrain.pipeline.tied import tied_aliases
from pipetrain.workloads.hf.causal_lm import HFCausalLM
from pipetrain.workloads.hf.workload import check_model_folder

__all__ = ["ModelSource", "model_source", "load_block_weights"]


class ModelSource:
    """Where the weights come from: `folder` (config, tokenizer, and the weights unless `checkpoint` is set)."""

    def __init__(self, folder: Path, checkpoint: Path | None = None, lora: dict | None = None) -> None:
        self.folder, self.checkpoint, self.lora = folder, checkpoint, lora

    def model(self, seq_len: int | None = None) -> HFCausalLM | LoraBlocks:
        """The `HFCausalLM` of the folder (reading its own weights only without a checkpoint); for a LoRA
        checkpoint, its base (weights from the folder) with the adapters' layers on (`LoraBlocks`)."""
        model = HFCausalLM.from_folder(self.folder, seq_len=seq_len or 1)
        if self.lora is not None:
            return LoraBlocks(model, LoraSettings(**self.lora), workload="hf")
        if self.checkpoint is not None:
            model.checkpoint = None  # the blocks are filled from the checkpoint instead
        return model

    def describe(self) -> str:
        if self.checkpoint is None:
            return str(self.folder)
        kind = "LoRA adapters over" if self.lora is not None else "fine-tuned from"
        return f"{self.checkpoint} ({kind} {self.folder})"


def model_source(model_dir: str | Path | None, checkpoint: str | Path | None) -> ModelSource:
    """The one source `--model DIR` or `--checkpoint CK` names; ConfigError for both or neither, and for a
    checkpoint that is not a Hugging Face model's."""
    if (model_dir is None) == (checkpoint is None):
        raise ConfigError("pass exactly one of --model DIR and --checkpoint CK"
                          + (" (both were given)" if model_dir is not None else ""),
                          hint="--model DIR: a Hugging Face folder; --checkpoint CK: a step-NNNNNNNN folder (or a "
                               "--save-dir) of `pipetrain train --workload hf --model DIR`")
    if model_dir is not None:
        return ModelSource(check_model_folder(Path(model_dir)))
    folder = find_checkpoint(checkpoint)
    config = read_meta(folder).config
    if config.get("workload") != "hf" or not config.get("model_dir"):
        raise ConfigError(f"checkpoint {str(folder)!r} was not trained from a Hugging Face model folder (workload "
                          f"{config.get('workload')!r}, model folder {config.get('model_dir')!r})",
                          hint="pass the checkpoint of a `pipetrain train --workload hf --model DIR` run")
    return ModelSource(check_model_folder(Path(config["model_dir"])), folder, config.get("lora"))


def load_block_weights(checkpoint: Path, model: HFCausalLM | LoraBlocks, blocks: dict[int, nn.Module]) -> None:
    """Fill `blocks` (block index -> block, before any TP split) from the layout-free weights of `checkpoint`,
    reading only their keys (a tied copy from the one tensor stored); of a LoRA model, the adapters only."""
    meta = read_meta(checkpoint)
    check_compatible(meta, checkpoint, model_name=None, fingerprint_=fingerprint(model), model=model)
    adapters_only = isinstance(model, LoraBlocks)
    aliases = tied_aliases(model, model.num_blocks)
    wanted = {index: {name: tensor for name, tensor in block.state_dict().items()
                      if not adapters_only or is_adapter(name)} for index, block in blocks.items()}
    targets: dict[str, torch.Tensor] = {}
    for index, state in wanted.items():
        for name, tensor in state.items():
            key = aliases.get(f"{index}.{name}", f"{index}.{name}")
            targets.setdefault(f"model.{key}", torch.empty_like(tensor))
    try:
        with warnings.catch_warnings():  # each rank reads its keys on its own, without the process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, checkpoint_id=str(checkpoint), no_dist=True)
    except (Exception, dcp.CheckpointException) as err:
        raise CheckpointError(f"could not read checkpoint {str(checkpoint)!r}: {err}",
                              hint="the checkpoint is damaged; pass an older one") from None
    with torch.no_grad():
        for index, state in wanted.items():
            for name, tensor in state.items():
                tensor.copy_(targets[f"model.{aliases.get(f'{index}.{name}', f'{index}.{name}')}"])
