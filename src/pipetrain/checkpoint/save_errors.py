"""What a failed save or load says: the lowest failing rank's underlying error of DCP's CheckpointException, and
the error a failed save raises (a full or read-only disk, or a peer lost during the save)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp

from pipetrain.errors import CheckpointError, PipetrainError, RankFailedError

__all__ = ["root_failure", "failure_text", "save_failed"]


def root_failure(err: BaseException) -> tuple[BaseException, int | None]:
    """The lowest failing rank's underlying exception of a DCP CheckpointException, and that rank."""
    rank = None
    if isinstance(err, dcp.CheckpointException) and err.failures:
        rank = min(err.failures)
        err = err.failures[rank][0]
    while err.__cause__ is not None:
        err = err.__cause__
    return err, rank


def failure_text(err: BaseException) -> str:
    """The root failure of `err` as "Type: message (rank N)"."""
    root, rank = root_failure(err)
    return f"{type(root).__name__}: {root}" + ("" if rank is None else f" (rank {rank})")


def save_failed(final: Path, err: BaseException) -> PipetrainError:
    """A full or read-only disk says so; a peer lost during the save (a rank died) is a rank failure."""
    root, _ = root_failure(err)
    if isinstance(root, OSError):
        return CheckpointError(f"could not write checkpoint {str(final)!r}: {failure_text(err)}",
                               hint="free space or pass a --save-dir you can write to; "
                                    "the previous checkpoints are intact")
    return RankFailedError(f"the save of checkpoint {str(final)!r} failed: {failure_text(err)}",
                           hint="another rank probably failed first; the previous checkpoints are intact")
