"""A durable job's settings (`pipetrain train --save-dir ... --step-timeout ... --save-timeout ...`): what is saved,
when, how long a step, a save or a load may take, and the checks before any rank starts (the save folder writable,
the checkpoint to resume fits the model and the batch size)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetrain.checkpoint.folders import probe_writable, read_meta
from pipetrain.errors import ConfigError

if TYPE_CHECKING:
    from pipetrain.blocks import BlockModel
    from pipetrain.pipeline import PipelineEngine

__all__ = ["DurableConfig", "DEFAULT_STEP_TIMEOUT_S", "DEFAULT_KEEP", "DEFAULT_SAVE_TIMEOUT_S", "SAVE_RATE_BYTES_S",
           "state_bytes"]

#: Seconds without a finished step before the watchdog ends the job (a cpu-preset step takes ~0.3 s).
DEFAULT_STEP_TIMEOUT_S = 300.0
#: Seconds a save, a resume's load or the first step may take by default (--save-timeout; a save adds the time
#: its bytes take at SAVE_RATE_BYTES_S).
DEFAULT_SAVE_TIMEOUT_S = 600.0
#: The rate the default --save-timeout allows for writing the whole job's checkpoint: a slow shared file system
#: (100 GB of a 7-8B full fine-tune's optimizer state: 5,000 s more).
SAVE_RATE_BYTES_S = 20e6
#: Checkpoints a job keeps by default (the newest; older ones are removed after each save). None keeps all.
DEFAULT_KEEP = 3


@dataclass(frozen=True, kw_only=True)
class DurableConfig:
    """Checkpointing and failure handling of one job (`pipetrain train --save-dir ... --step-timeout ...`).

    `resume` goes on from the latest complete checkpoint in `save_dir`, or from `resume_from` when set (a
    `step-N` folder, or a folder holding them). `keep` bounds the checkpoints kept (None: all).
    """

    save_dir: Path | None = None
    save_every: int | None = None
    resume: bool = False
    resume_from: Path | None = None
    keep: int | None = DEFAULT_KEEP
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S
    #: seconds a save, a resume's load or the first step may take (None: DEFAULT_SAVE_TIMEOUT_S, a save plus the
    #: time of its bytes at SAVE_RATE_BYTES_S)
    save_timeout_s: float | None = None
    async_save: bool = False  # write checkpoints in the background (see checkpoint.background)
    requeue_job: str | None = None  # the Slurm job id to requeue after a stop request (None: not under Slurm)

    @property
    def process_group_timeout_s(self) -> float:
        """The collectives' own timeout: above `step_timeout_s`, so that the step watchdog, which names the stuck
        rank, fires before NCCL's, which aborts the process (SIGABRT): 2 x the step timeout, at least 600 s
        (torch's default, kept when the step timeout is off), and at least --save-timeout (a first step that
        compiles long on one rank keeps the others waiting in a collective)."""
        base = max(600.0, 2.0 * self.step_timeout_s) if self.step_timeout_s else 600.0
        return max(base, self.save_timeout_s or 0.0)

    def save_limit_s(self, job_bytes: float) -> float:
        """The seconds a save or load of a checkpoint of `job_bytes` (the whole job's) may take."""
        if self.save_timeout_s is not None:
            return self.save_timeout_s
        return DEFAULT_SAVE_TIMEOUT_S + job_bytes / SAVE_RATE_BYTES_S

    @property
    def first_step_limit_s(self) -> float:
        """The seconds the first step (schedules built, compilation) may take."""
        return self.save_timeout_s if self.save_timeout_s is not None else DEFAULT_SAVE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.resume and self.save_dir is None:
            raise ConfigError("--resume needs --save-dir (or a checkpoint: --resume DIR/step-N)",
                              hint="pass --save-dir DIR, the folder the job saved to")
        if self.resume_from is not None and not self.resume:
            raise ConfigError("resume_from is set but resume is not", hint="pass resume=True with resume_from")
        if self.save_dir is None and self.async_save:
            raise ConfigError("--async-save needs --save-dir", hint="pass --save-dir DIR, or drop --async-save")
        if self.save_dir is None and self.save_every is not None:
            raise ConfigError("--save-every needs --save-dir", hint="pass --save-dir DIR")
        for name in ("save_every", "keep"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be 1 or more, got {value}",
                                  hint=f"pass --{name.replace('_', '-')} 1 or more")
        if self.step_timeout_s is not None and self.step_timeout_s <= 0:
            raise ConfigError(f"--step-timeout must be positive, got {self.step_timeout_s:g}",
                              hint="pass seconds well above one step, e.g. --step-timeout 300")
        if self.save_timeout_s is not None and self.save_timeout_s <= 0:
            raise ConfigError(f"--save-timeout must be positive, got {self.save_timeout_s:g}",
                              hint="pass seconds well above one save, e.g. --save-timeout 3600, or leave it out "
                                   "(600 s plus 1 s per 20 MB of checkpoint)")

    @property
    def resume_path(self) -> Path | None:
        """Where `resume` reads: `resume_from`, else `save_dir` (its latest complete checkpoint)."""
        return self.resume_from if self.resume_from is not None else self.save_dir

    def check(self, *, model_name: str, model: BlockModel, batch_size: int | None = None) -> None:
        """Before any rank starts: the save folder is writable and, with --resume, holds a checkpoint of `model`
        (saved inside an epoch: by a job of the same global `batch_size`, when given)."""
        from pipetrain.checkpoint.keys import fingerprint  # torch: not at import (the flags are checked before it)
        from pipetrain.checkpoint.meta import check_compatible, find_checkpoint

        if self.save_dir is None:
            return
        probe_writable(self.save_dir)
        if self.resume:
            folder = find_checkpoint(self.resume_path)
            meta = read_meta(folder)
            check_compatible(meta, folder, model_name=model_name, fingerprint_=fingerprint(model), model=model)
            if "position" not in meta.extras:
                raise ConfigError(f"checkpoint {str(folder)!r} was saved from a Python loop, not by `pipetrain train`: "
                                  "it does not say where training stopped",
                                  hint="load it with pipetrain.checkpoint.load_checkpoint in your loop, or pass "
                                       "another --save-dir")
            _check_batch_size(meta.extras["position"], meta.config.get("batch_size"), batch_size, folder)


def state_bytes(engine: PipelineEngine) -> int:
    """The bytes this rank's part of a checkpoint holds, about: its trained parameters (the local shards) with
    AdamW's two moments, in their own dtype (a LoRA base's frozen weights are not saved)."""
    total = 0
    for parameter in engine.parameters():
        if parameter.requires_grad:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            total += local.numel() * local.element_size()
    return 3 * total


def _check_batch_size(position: Mapping[str, Any], saved: int | None, batch_size: int | None, folder: Path) -> None:
    """A checkpoint saved inside an epoch is resumed with the global batch it was saved with: its position counts
    that epoch's batches (and, with --bucket, the epoch's order groups samples in batches of that size)."""
    if batch_size is None or saved is None or saved == batch_size or not position.get("in_epoch"):
        return
    raise ConfigError(f"checkpoint {str(folder)!r} was saved inside epoch {position.get('epoch')} by a job of global "
                      f"batch size {saved}, this job's is {batch_size}",
                      hint=f"resume with --batch-size {saved} (the global batch; dp, pp and tp may change)")
