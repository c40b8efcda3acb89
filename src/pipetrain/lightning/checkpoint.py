"""Lightning checkpoints of a pipelined model: pipetrain checkpoints with Lightning's training state beside them.

`Trainer.save_checkpoint(path)` (and `ModelCheckpoint`) writes a folder at `path`: the model and optimizer state of
every rank under layout-free keys (`<block>.<name in block>`, DCP shards, as `pipetrain train --save-dir` writes),
`pipetrain.json`, and `lightning.pt` with the rest of Lightning's checkpoint (epoch, step, loops, callbacks, LR
schedulers, hyper-parameters). So the folder loads under any other layout (`Trainer.fit(ckpt_path=...)` with another
`PipelineStrategy`), into one process (`pipetrain.checkpoint.read_weights(path, blocks)`, the state dict of
`build_sequential(blocks)`), or with `pipetrain export`. The folder is written as `<path>.partial` and renamed once
every rank has written its part: a reader sees the whole checkpoint or none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pipetrain.checkpoint.folders import commit, write_meta
from pipetrain.checkpoint.state import checkpoint_meta, load_checkpoint, save_failed, saved_state
from pipetrain.errors import CheckpointError
from pipetrain.pipeline import PipelineEngine

__all__ = ["LIGHTNING_FILE", "load_lightning_checkpoint", "save_lightning_checkpoint"]

#: The file of a checkpoint folder holding Lightning's own state (everything but the model and optimizer).
LIGHTNING_FILE = "lightning.pt"
_OWN = ("state_dict", "optimizer_states")


def save_lightning_checkpoint(path: Path, checkpoint: dict[str, Any], engine: PipelineEngine,
                              optimizer: torch.optim.Optimizer | None, *, model_name: str) -> None:
    """Write Lightning's `checkpoint` of `engine` (and `optimizer`) as the folder `path`; a collective call."""
    partial = path.with_name(path.name + ".partial")
    error = None
    if _rank() == 0:
        try:
            if path.is_file():  # a single-file checkpoint of an earlier run
                path.unlink()
            partial.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            error = f"cannot write checkpoint {str(path)!r}: {err}"
    _agree(error)
    try:
        dcp.save(saved_state(engine, optimizer), checkpoint_id=str(partial))
    except (Exception, dcp.CheckpointException) as err:
        raise save_failed(path, err) from None
    if _rank() == 0:
        try:
            meta = checkpoint_meta(engine, int(checkpoint.get("global_step", 0)), model_name, None,
                                   {"lightning": LIGHTNING_FILE})
            torch.save({k: v for k, v in checkpoint.items() if k not in _OWN}, partial / LIGHTNING_FILE)
            write_meta(partial, meta)
            commit(partial, path)
        except OSError as err:
            error = f"could not commit checkpoint {str(path)!r}: {err}"
    _agree(error)


def load_lightning_checkpoint(path: Path, engine: PipelineEngine,
                              optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load the model and optimizer state of the checkpoint folder `path` into `engine` and `optimizer` (under any
    layout; a collective call); returns Lightning's part of the checkpoint, for the Trainer to restore."""
    load_checkpoint(path, engine, optimizer)
    lightning = path / LIGHTNING_FILE
    if not lightning.is_file():
        raise CheckpointError(f"{str(path)!r} is a pipetrain checkpoint without Lightning's state ({LIGHTNING_FILE})",
                              hint="load its weights with pipetrain.checkpoint.read_weights, or pass a checkpoint "
                                   "a Trainer with PipelineStrategy saved")
    state = torch.load(lightning, map_location="cpu", weights_only=False)
    return {**state, "state_dict": {}, "optimizer_states": []}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(error: str | None) -> None:
    """Raise CheckpointError on every rank when rank 0 reports `error`."""
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0], hint="free space or save to a folder you can write to")
