"""Checkpoints of the whole training state with torch.distributed.checkpoint: layout-free, atomic, resumable.

For a loop you own (every rank calls both; they are collectives)::

    from pipetrain.checkpoint import save_checkpoint, load_checkpoint
    save_checkpoint("ckpt", session.engine, optimizer, step=step, extras={"epoch": epoch})
    meta = load_checkpoint("ckpt", session.engine, optimizer)   # the latest complete one
    step, epoch = meta.step, meta.extras["epoch"]
"""

from pipetrain.checkpoint.export import export_checkpoint
from pipetrain.checkpoint.folders import CheckpointMeta, complete_checkpoints, latest_checkpoint, probe_writable, read_meta
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.checkpoint.state import engine_layout, find_checkpoint, load_checkpoint, save_checkpoint

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
