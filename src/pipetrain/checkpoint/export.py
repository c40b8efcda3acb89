"""Export: one consolidated state dict of the unsplit `nn.Sequential`, read from a sharded checkpoint in one process."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from pipetrain.blocks import BlockModel, build_sequential
from pipetrain.checkpoint.folders import read_meta
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.checkpoint.state import check_compatible, find_checkpoint, frozen_model
from pipetrain.errors import CheckpointError, ConfigError
from pipetrain.pipeline.tied import tied_aliases

__all__ = ["export_checkpoint", "read_weights"]


def read_weights(checkpoint: str | Path, model: BlockModel) -> dict[str, torch.Tensor]:
    """The model weights of `checkpoint` (a `step-N` folder or a --save-dir), read in this one process, as the
    state dict of `pipetrain.build_sequential(model)` (keys `<block>.<name in block>`; every copy of a tied
    weight filled from the one stored). For a LoRA model the checkpoint holds the adapters, the base comes from
    the model's own folder (checked to be the one the adapters were trained on)."""
    folder = find_checkpoint(checkpoint)
    meta = read_meta(folder)
    check_compatible(meta, folder, model_name=None, fingerprint_=fingerprint(model), model=model)
    sequential = build_sequential(model, seed=0)
    aliases = tied_aliases(model, model.num_blocks)  # copies of a tied weight: stored once, under the canonical key
    state = {f"model.{key}": value for key, value in sequential.state_dict().items() if key not in aliases}
    if frozen_model(model):  # adapters only are stored: the frozen base is the one its folder holds
        trained = {f"model.{name}" for name, param in sequential.named_parameters() if param.requires_grad}
        base = {key[len("model."):]: value for key, value in state.items() if key not in trained}
        state = {key: value for key, value in state.items() if key in trained}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, dcp.CheckpointException) as err:
        raise CheckpointError(f"could not read checkpoint {str(folder)!r}: {err}",
                              hint="the checkpoint is damaged; export an older one") from None
    weights = {key[len("model."):]: value.detach().clone() for key, value in state.items()}
    if frozen_model(model):
        weights = {**base, **weights}
    weights.update({alias: weights[canonical] for alias, canonical in aliases.items()})
    return weights


def export_checkpoint(checkpoint: str | Path, model: BlockModel, file: str | Path) -> dict[str, torch.Tensor]:
    """Write the model weights of `checkpoint` (a `step-N` folder or a --save-dir) to `file` with `torch.save`.

    No process group is needed. The file holds the state dict of `pipetrain.build_sequential(model)`
    (keys `<block>.<name in block>`): `nn.Sequential.load_state_dict(torch.load(file, weights_only=True))`.
    Returns that state dict.
    """
    weights = read_weights(checkpoint, model)
    file = Path(file)
    if file.is_dir():
        raise ConfigError(f"export target {str(file)!r} is a folder", hint="pass a file path, e.g. model.pt")
    partial = file.with_name(f".{file.name}.partial")
    try:
        torch.save(weights, partial)
        partial.replace(file)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write {str(file)!r}: {err.strerror or err}",
                              hint="pass a file path in a folder you can write to") from None
    return weights
