"""The checkpoint and failure flags of `train`: --save-dir, --resume, --keep, --async-save, --step-timeout,
--save-timeout."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.checkpoint.durable_config import (
    DEFAULT_KEEP,
    DEFAULT_SAVE_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    SAVE_RATE_BYTES_S,
    DurableConfig,
)
from pipetrain.checkpoint.folders import META_FILE, latest_checkpoint
from pipetrain.errors import ConfigError
from pipetrain.launch.env import slurm_job_id

__all__ = ["add_durable_arguments", "durable_config", "RESUME_IF_ANY"]

#: `--resume auto`: go on from the latest complete checkpoint in --save-dir when there is one, else start afresh.
RESUME_IF_ANY = "auto"


def add_durable_arguments(parser: argparse.ArgumentParser) -> None:
    """Checkpoints, resume and failure detection (see pipetrain.checkpoint)."""
    group = parser.add_argument_group("checkpoints and failures")
    group.add_argument("--save-dir", type=Path, default=None,
                       help="save checkpoints here (at each epoch end, at the end, and on SIGTERM/SIGUSR1)")
    group.add_argument("--save-every", type=int, default=None, help="also save every N optimizer steps")
    group.add_argument("--resume", nargs="?", const=True, default=False, type=Path, metavar="CHECKPOINT",
                       help="go on from the latest complete checkpoint in --save-dir, or from CHECKPOINT (a "
                            "step-N folder, or a folder of them; --save-dir then defaults to its folder); "
                            "any layout may resume it; `--resume auto`: the latest in --save-dir when there is one, "
                            "else start afresh (one command for the first start and every restart: torchrun "
                            "elastic, Slurm requeue)")
    group.add_argument("--keep", type=_keep, default=None, metavar="K|all",
                       help=f"keep the K newest checkpoints, or all (default: {DEFAULT_KEEP})")
    group.add_argument("--async-save", action="store_true",
                       help="write checkpoints in the background: training waits only while the state is copied")
    group.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                       help=f"end the job when no step finishes for this many seconds, naming the stuck rank; "
                            f"0 disables (default: {DEFAULT_STEP_TIMEOUT_S:g})")
    group.add_argument("--save-timeout", type=float, default=None, metavar="SECONDS",
                       help="the watchdog's limit for a checkpoint's save, a resume's load and the first step "
                            "(schedules built, compilation) instead of --step-timeout (default: "
                            f"{DEFAULT_SAVE_TIMEOUT_S:g} s, a save or load plus 1 s per {SAVE_RATE_BYTES_S / 1e6:g} MB "
                            "of the job's checkpoint)")


def _keep(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--keep takes a number of checkpoints or 'all', got {text!r}") from None


def durable_config(args: argparse.Namespace) -> DurableConfig:
    """The validated checkpoint and failure-handling configuration of parsed arguments."""
    resume = args.resume
    if isinstance(resume, Path) and str(resume) == RESUME_IF_ANY:  # resume when the save folder holds a checkpoint
        if args.save_dir is None:
            raise ConfigError("--resume auto needs --save-dir (the folder whose latest checkpoint a restart resumes)",
                              hint="pass --save-dir DIR")
        resume = latest_checkpoint(args.save_dir) is not None
    resume_from = resume if isinstance(resume, Path) else None
    if resume_from is not None and not resume_from.exists():  # before --save-dir creates anything
        raise ConfigError(f"--resume {str(resume_from)!r}: no such checkpoint or folder",
                          hint="pass a step-NNNNNNNN folder or the --save-dir holding them, or --resume alone "
                               "for the latest in --save-dir")
    save_dir = args.save_dir
    if save_dir is None and resume_from is not None:  # go on saving beside the checkpoint resumed
        save_dir = resume_from.parent if (resume_from / META_FILE).is_file() else resume_from
    if args.keep is not None and save_dir is None:
        raise ConfigError("--keep needs --save-dir", hint="pass --save-dir DIR")
    keep = DEFAULT_KEEP if args.keep is None else None if args.keep == "all" else args.keep
    return DurableConfig(save_dir=save_dir, save_every=args.save_every, resume=bool(resume),
                         resume_from=resume_from, keep=keep, step_timeout_s=args.step_timeout or None,
                         save_timeout_s=getattr(args, "save_timeout", None), async_save=args.async_save,
                         requeue_job=slurm_job_id())
