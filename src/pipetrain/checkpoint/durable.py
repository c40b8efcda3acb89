"""What the trainer calls to make a job durable: resume, periodic saves, agreed stops, requeue, step watchdog.

The watchdog's `--step-timeout` is for steps; a save, a resume's load and the first step (schedules built,
compilation) run under `--save-timeout` instead (default: 600 s plus 1 s per 20 MB of the job's checkpoint), and
the checkpoint's own collectives run on a process group whose timeout is that limit too.
"""

from __future__ import annotations

import copy
import logging
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.checkpoint.background import BackgroundSaver
from pipetrain.checkpoint.durable_config import (
    DEFAULT_KEEP,
    DEFAULT_SAVE_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    SAVE_RATE_BYTES_S,
    DurableConfig,
    state_bytes,
)
from pipetrain.checkpoint.state import find_checkpoint, load_checkpoint, save_checkpoint
from pipetrain.checkpoint.stop import StopRequest
from pipetrain.launch.env import elastic_round
from pipetrain.launch.hangs import HangReport
from pipetrain.launch.spawn import RankSpec, fail_now
from pipetrain.launch.watchdog import StepWatchdog
from pipetrain.pipeline import PipelineEngine

__all__ = ["DurableConfig", "Position", "DurableRun", "DEFAULT_STEP_TIMEOUT_S", "DEFAULT_KEEP", "DEFAULT_SAVE_TIMEOUT_S",
           "SAVE_RATE_BYTES_S", "state_bytes"]

log = logging.getLogger("pipetrain")

@dataclass
class Position:
    """Where training is: optimizer steps done, the epoch under way (1-based), its batches done, the global
    samples of its order done (`sample`: where its next batch starts, under any layout; None in a checkpoint
    written before it was recorded: `in_epoch` full batches), the samples trained in the whole run (`samples`),
    what the epoch has measured so far (`totals`), the reports of finished epochs (`reports`) and the training
    recipe's state (`recipe`: its skipped-step count; the LR is a function of `step`), all JSON data."""

    step: int = 0
    epoch: int = 1
    in_epoch: int = 0
    totals: dict[str, float] = field(default_factory=dict)
    reports: list[dict[str, Any]] = field(default_factory=list)
    recipe: dict[str, Any] = field(default_factory=dict)
    sample: int | None = 0
    samples: int = 0
    #: a digest of the data trained on (None: not known, or saved before it was recorded): a resume on other data
    #: would skip or repeat samples, and is refused (`pipetrain.train.prepare`)
    data: str | None = None

    def start(self, batch_size: int) -> int:
        """The global sample of the epoch's order the next batch begins with."""
        return self.in_epoch * batch_size if self.sample is None else self.sample


class DurableRun:
    """One rank's side of a durable job; a no-op without --save-dir (except the watchdog).

    The loop calls `start()` once (it resumes), `after_step(position)` after each optimizer step (True: stop
    now, every rank agrees), `progress()` and `stop_requested()` after each evaluation batch, `end_epoch(position)`
    and `close()`.
    """

    def __init__(self, config: DurableConfig, engine: PipelineEngine, optimizer: torch.optim.Optimizer, *,
                 model_name: str, job_config: Mapping[str, Any], device: torch.device, spec: RankSpec,
                 hang_dir: Path | None = None, data_digest: str | None = None) -> None:
        self.config = config
        self.data_digest = data_digest
        self.engine = engine
        self.optimizer = optimizer
        self.model_name = model_name
        self.job_config = dict(job_config)
        self.device = device
        self._stop = StopRequest()
        self._watchdog = None
        self._save_limit_s = config.save_limit_s(state_bytes(engine) * spec.world_size)
        self._group = None  # DCP's collectives in a save or load: their timeout is the save's limit
        if dist.is_initialized() and (config.save_dir is not None or config.resume) and not config.async_save:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._save_limit_s))
        if config.step_timeout_s:
            self._watchdog = StepWatchdog(timeout_s=config.step_timeout_s, rank=spec.rank, world_size=spec.world_size,
                                          master_addr=spec.master_addr, master_port=spec.master_port, on_stuck=fail_now,
                                          hang=HangReport(hang_dir, spec.rank), round_=elastic_round())
        self._step = 0
        self._saved: dict[str, Any] | None = None
        self._saver = (BackgroundSaver(timeout_s=self._save_limit_s) if config.async_save and config.save_dir is not None
                       else None)
        self.stopped_by: str | None = None
        #: the job configuration the resumed checkpoint was saved with (None: not resumed)
        self.resumed_config: dict[str, Any] | None = None

    @property
    def saving(self) -> bool:
        return self.config.save_dir is not None

    def start(self) -> Position:
        """Resume from the latest checkpoint with --resume (else start afresh); start watching."""
        position = Position()
        if self.saving:
            self._stop.install()
        if self._watchdog is not None:
            self._watchdog.start()
        if self.config.resume:
            source = self.config.resume_path
            assert source is not None
            folder = find_checkpoint(source)
            with self._long(f"the load of checkpoint {folder.name}"):
                meta = load_checkpoint(folder, self.engine, self.optimizer, model_name=self.model_name,
                                       process_group=self._group)
            position = Position(**{"sample": None, **meta.extras["position"]})  # None: saved before it was recorded
            self._saved = copy.deepcopy({**position.__dict__, "data": None})
            self.resumed_config = dict(meta.config)
            if dist.get_rank() == 0:
                log.info("pipetrain: resumed from %s (step %d, epoch %d, %d batches of it done; its next sample: "
                         "%s of its order)", folder, position.step, position.epoch, position.in_epoch,
                         "?" if position.sample is None else position.sample)
        self._step = position.step
        if self._watchdog is not None:
            self._watchdog.progress(position.step)
            self._watchdog.until_next_step(self.config.first_step_limit_s, f"step {position.step + 1}, the first "
                                           "(schedules built, compilation)")
        return position

    @contextmanager
    def _long(self, what: str) -> Iterator[None]:
        """Long work (a save, a load, a wait for a background save): under --save-timeout, not --step-timeout."""
        with self._watchdog.during(self._save_limit_s, what) if self._watchdog is not None else nullcontext():
            yield

    def progress(self) -> None:
        """Something other than a step finished (an evaluation batch): the job is alive."""
        if self._watchdog is not None:
            self._watchdog.progress(self._step)

    def stop_requested(self) -> bool:
        """Between evaluation batches: True on every rank when any rank got a stop signal (a collective), so that
        an evaluation stops at the next batch, not at its end; the loop then stops as after a step. Always False
        without --save-dir (no stop signal is caught: it ends the job at once)."""
        if not self.saving or not self._stop.agreed(self.device):
            return False
        self.stopped_by = self._stop.signal_name
        return True

    def after_step(self, position: Position) -> bool:
        """Save when due; True when a stop was requested on any rank (then the checkpoint is saved)."""
        self._step = position.step
        if self._watchdog is not None:
            self._watchdog.progress(position.step)
        if not self.saving:
            return False
        if self._stop.agreed(self.device):
            self.stopped_by = self._stop.signal_name
            self.save(position)
            self.finish()  # the job ends now: its last checkpoint must be committed
            return True
        if self.config.save_every and position.step % self.config.save_every == 0:
            self.save(position)
        return False

    def end_epoch(self, position: Position) -> None:
        """Save at the end of an epoch (after its evaluation, so the report is in the checkpoint)."""
        if self.saving:
            self.save(position)

    def save(self, position: Position) -> None:
        """Save now unless this very position is already saved."""
        current = {**position.__dict__, "data": None}
        if self.config.save_dir is None or self._saved == current:
            return
        where = {} if self._saver is not None else {"process_group": self._group}
        save = self._saver.save if self._saver is not None else save_checkpoint
        with self._long(f"the save of checkpoint step {position.step}"):
            save(self.config.save_dir, self.engine, self.optimizer, step=position.step, model_name=self.model_name,
                 config=self.job_config, extras={"position": {**current, "data": self.data_digest}},
                 keep=self.config.keep, **where)
        self._saved = copy.deepcopy(current)
        self.progress()

    def requeue(self) -> None:
        """After a stop request under Slurm: rank 0 asks Slurm to requeue this job (it then resumes by itself)."""
        if self.config.requeue_job is None or dist.get_rank() != 0:
            return
        done = subprocess.run(["scontrol", "requeue", self.config.requeue_job], capture_output=True, text=True,
                              check=False)
        if done.returncode:
            log.warning("pipetrain: `scontrol requeue %s` failed: %s", self.config.requeue_job, done.stderr.strip())
        else:
            log.info("pipetrain: requeued Slurm job %s; it resumes from the checkpoint", self.config.requeue_job)

    def finish(self) -> None:
        """At the end of a job that went well: wait until the background save in flight, if any, is committed."""
        if self._saver is not None:
            with self._long("the background save in flight"):
                self._saver.wait()
            self.progress()

    def close(self) -> None:
        """Stop watching (no collectives: it also runs after an error, when a background save is abandoned)."""
        if self._saver is not None:
            self._saver.close()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._stop.uninstall()
