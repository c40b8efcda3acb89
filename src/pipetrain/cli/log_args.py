"""The logging and validation flags of `pipetrain train` (`--run-dir`, `--log-every`, `--tensorboard`,
`--eval-every`, `--eval-batches`, `--peak-tflops`, `--straggler-factor`, `--sample-every`,
`--sample-prompt`, `--sample-tokens`) and the `LogConfig` they make."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.logs.config import LogConfig, default_run_dir

__all__ = ["add_log_arguments", "log_config"]


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the group "logs" to `parser`."""
    group = parser.add_argument_group("logs")
    group.add_argument("--run-dir", type=Path, default=None, metavar="DIR",
                       help="the run's folder: steps.jsonl (every step and evaluation) and config.toml (the "
                            "effective configuration), written by rank 0 (default: runs/<workload>-<UTC time>-p<pid>)")
    group.add_argument("--log-every", type=int, default=10, metavar="N",
                       help="a console line every N steps when no progress bar is shown (default: 10)")
    group.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                       help="also write TensorBoard event files to DIR (needs pip install 'pipetrain[tensorboard]')")
    group.add_argument("--eval-every", type=int, default=None, metavar="N",
                       help="also evaluate on the held-out data every N optimizer steps (default: only at "
                            "the end of each epoch)")
    group.add_argument("--eval-batches", type=int, default=None, metavar="K",
                       help="read at most K held-out batches per evaluation, at the end of each epoch and with "
                            "--eval-every (default: all)")
    group.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                       help="peak TFLOP/s of one device, for MFU (default: from the GPU's name; no MFU on CPU)")
    group.add_argument("--straggler-factor", type=float, default=1.3, metavar="F",
                       help="every --log-every steps, name a rank whose step computes F times longer than the "
                            "median of the other replicas of its stage (default: 1.3)")
    group.add_argument("--sample-every", type=int, default=None, metavar="N",
                       help="with --workload hf --model DIR: every N steps, generate from --sample-prompt through "
                            "the training stages (greedy), shown in the console and in TensorBoard as text")
    group.add_argument("--sample-prompt", default=None, metavar="TEXT", help="the prompt of --sample-every")
    group.add_argument("--sample-tokens", type=int, default=32, metavar="N",
                       help="new tokens of each --sample-every sample (default: 32)")


def log_config(args: argparse.Namespace) -> LogConfig:
    """The validated `LogConfig` of parsed arguments (with the training group's `--metrics` and the layout group's
    `--layout-prediction`); its `config_text` is written from the whole job description (cli/train_args.py)."""
    from pipetrain.workloads.loader import workload_label  # torch: not at import (bad flags are said before it)

    return LogConfig(run_dir=args.run_dir if args.run_dir is not None else default_run_dir(workload_label(args.workload)),
                     log_every=args.log_every, tensorboard=args.tensorboard, eval_every=args.eval_every,
                     eval_batches=args.eval_batches, peak_tflops=args.peak_tflops, metrics=args.metrics,
                     predicted=args.layout_prediction, straggler_factor=args.straggler_factor,
                     sample_every=getattr(args, "sample_every", None), sample_prompt=getattr(args, "sample_prompt", None),
                     sample_tokens=getattr(args, "sample_tokens", 32))
