"""Checkpoints written in the background (`--async-save`): training is blocked only while the state is copied.

`BackgroundSaver.save` copies this rank's state to CPU memory (DCP's `DefaultStager`, pinned on CUDA) and
returns; a thread writes the copy with `dcp.save` over a gloo process group of its own (the training's
collectives never meet the save's), and rank 0 commits the checkpoint once every rank's shards are written: the
same atomic commit as a synchronous save, so a job killed during a background write leaves the previous
checkpoint the latest complete one. One save is in flight at a time: the next save, and `wait`, wait for it
and agree on its outcome.
(`dcp.async_save` itself is not used: in torch 2.13 it logs two DCP debug events per state-dict key on the
calling thread, which blocked training three times longer than the copy.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from pipetrain.checkpoint.folders import CheckpointMeta
from pipetrain.checkpoint.keys import fingerprint
from pipetrain.checkpoint.state import begin_save, checkpoint_meta, commit_save, save_failed, saved_state
from pipetrain.errors import CheckpointError
from pipetrain.pipeline import PipelineEngine

__all__ = ["BackgroundSaver"]

log = logging.getLogger("pipetrain")


@dataclass
class _InFlight:
    step: int
    final: Path
    thread: threading.Thread | None = None
    error: str | None = None


class BackgroundSaver:
    """This rank's side of the job's background saves (made on every rank: it creates a process group)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        """`timeout_s`: the longest one of the group's collectives may wait (a rank still writing; None: torch's)."""
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        pinned = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
        self._in_flight: _InFlight | None = None
        self._fingerprint: str | None = None

    def save(self, directory: Path, engine: PipelineEngine, optimizer: torch.optim.Optimizer | None, *, step: int,
             model_name: str, config: Mapping[str, Any] | None, extras: Mapping[str, Any] | None,
             keep: int | None) -> Path:
        """Start writing the checkpoint of `step` (a collective call) once the previous one is committed;
        returns the folder it will be committed to."""
        self.wait()
        partial, final = begin_save(directory, step)
        staged = self._stager.stage(saved_state(engine, optimizer))  # the copy the thread writes
        meta = None
        if _rank() == 0:
            self._fingerprint = self._fingerprint or fingerprint(engine.model)  # builds every block: once a job
            meta = checkpoint_meta(engine, step, model_name, config, extras, fingerprint_=self._fingerprint)
        in_flight = _InFlight(step, final)
        in_flight.thread = threading.Thread(target=self._write, args=(in_flight, staged, partial, meta, keep),
                                            name=f"pipetrain-save-{step}", daemon=True)
        in_flight.thread.start()
        self._in_flight = in_flight
        return final

    def _write(self, in_flight: _InFlight, staged: dict[str, Any], partial: Path, meta: CheckpointMeta | None,
               keep: int | None) -> None:
        try:
            dcp.save(staged, checkpoint_id=str(partial), process_group=self._group, no_dist=self._group is None)
        except BaseException as err:  # recorded, raised on every rank by `wait`
            in_flight.error = str(save_failed(in_flight.final, err))
            return
        if meta is not None:
            in_flight.error = commit_save(partial, in_flight.final, meta, keep)

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any (a collective call): its committed folder, or CheckpointError on
        every rank when any rank's write or the commit failed."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        assert in_flight.thread is not None
        in_flight.thread.join()
        errors: list[str | None] = [in_flight.error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, in_flight.error)
        failed = next((error for error in errors if error is not None), None)
        if failed is not None:
            raise CheckpointError(failed, hint="free space or pass a --save-dir you can write to; "
                                               "the previous checkpoints are intact")
        return in_flight.final

    def abandon(self) -> None:
        """After an error elsewhere (no collectives): leave the save in flight unfinished; its partial folder is
        never read, and the next job's first save removes it."""
        thread = self._in_flight.thread if self._in_flight is not None else None
        if thread is not None and thread.is_alive():
            log.warning("pipetrain: the background save of step %d was left unfinished; the previous checkpoint "
                        "stays the latest complete one", self._in_flight.step)  # type: ignore[union-attr]
        self._in_flight = None

    def close(self) -> None:
        """Free the staging memory (no collectives; a save in flight is abandoned)."""
        self.abandon()
        self._stager.close()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
