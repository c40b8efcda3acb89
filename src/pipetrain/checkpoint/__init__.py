"""Checkpoints of the whole training state with torch.distributed.checkpoint: layout-free, atomic, resumable.

For a loop you own (every rank calls both; they are collectives)::

    from pipetrain.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint("ckpt", session.engine, optimizer, step=step, extras={"epoch": epoch})
    meta = load_checkpoint("ckpt", session.engine, optimizer)   # the latest complete one
    step, epoch = meta.step, meta.extras["epoch"]
"""

from typing import TYPE_CHECKING

from pipetrain.lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: the durable settings need no torch)
_EXPORTS = {
    "export_checkpoint": "pipetrain.checkpoint.export",
    **dict.fromkeys(("CheckpointMeta", "complete_checkpoints", "latest_checkpoint", "probe_writable", "read_meta"),
                    "pipetrain.checkpoint.folders"),
    "fingerprint": "pipetrain.checkpoint.keys",
    **dict.fromkeys(("engine_layout", "find_checkpoint", "load_checkpoint", "save_checkpoint"),
                    "pipetrain.checkpoint.state"),
}

__all__ = [
    "CheckpointMeta",
    "complete_checkpoints",
    "engine_layout",
    "export_checkpoint",
    "find_checkpoint",
    "fingerprint",
    "latest_checkpoint",
    "load_checkpoint",
    "probe_writable",
    "read_meta",
    "save_checkpoint",
]

if TYPE_CHECKING:
    from pipetrain.checkpoint.export import export_checkpoint
    from pipetrain.checkpoint.folders import (CheckpointMeta, complete_checkpoints, latest_checkpoint, probe_writable,
                                              read_meta)
    from pipetrain.checkpoint.keys import fingerprint
    from pipetrain.checkpoint.state import engine_layout, find_checkpoint, load_checkpoint, save_checkpoint

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
