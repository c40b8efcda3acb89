"""The training recipe's command-line flags (`--lr-schedule`, `--grad-clip`, ...) and their `RecipeConfig`."""

from __future__ import annotations

import argparse

from pipetrain.cli.layout_args import is_default, mark_defaults
from pipetrain.recipe.config import LR_SCHEDULES, WSD_DECAY_FRACTION, RecipeConfig

__all__ = ["add_recipe_arguments", "recipe_config", "left_open", "OPEN_DESTS"]

#: The defaults, all from `RecipeConfig` (the one place to change them).
DEFAULTS = RecipeConfig()
#: The recipe flags a workload may set for its data when they are not given (`Workload.recipe_defaults`).
OPEN_DESTS = ("lr_schedule", "warmup_steps", "grad_clip")
#: `--grad-clip none`: no clipping, whatever the workload's default.
NO_CLIP = "none"


def _grad_clip(text: str) -> float | str:
    return NO_CLIP if text.strip().lower() == NO_CLIP else float(text)


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The LR schedule, weight decay, clipping and non-finite flags (`--lr` itself is the training group's).

    Values are checked by `RecipeConfig` (one line and exit code 2), not by argparse choices.
    """
    group = parser.add_argument_group("optimization recipe")
    group.add_argument("--lr-schedule", default=DEFAULTS.lr_schedule,
                       help=f"learning rate over the run: {' | '.join(LR_SCHEDULES)} (default: the workload's for its data, "
                            f"else {DEFAULTS.lr_schedule}; the classifier on real reviews: cosine)")
    group.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps, metavar="N",
                       help=f"linear warm-up steps up to --lr (default: the workload's, else {DEFAULTS.warmup_steps}; the "
                            "classifier on real reviews: 30, at most a tenth of --max-steps)")
    group.add_argument("--min-lr", type=float, default=DEFAULTS.min_lr, metavar="LR",
                       help=f"where linear, cosine and wsd end (default: {DEFAULTS.min_lr:g})")
    group.add_argument("--decay-steps", type=int, default=DEFAULTS.decay_steps, metavar="N",
                       help=f"wsd: the last N steps decay linearly to --min-lr "
                            f"(default: {round(100 * WSD_DECAY_FRACTION)}%% of the run)")
    group.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay, metavar="WD",
                       help="AdamW weight decay of matrices (none on biases, norm weights, embeddings) "
                            f"(default: {DEFAULTS.weight_decay:g})")
    group.add_argument("--grad-clip", type=_grad_clip, default=DEFAULTS.grad_clip, metavar="MAX_NORM",
                       help="clip the global gradient L2 norm to MAX_NORM, or 'none' (default: the workload's, else "
                            "none; the classifier on real reviews: 1.0)")
    group.add_argument("--skip-nonfinite", type=int, default=DEFAULTS.skip_nonfinite, metavar="N",
                       help="skip up to N steps whose loss or gradient norm is nan/inf (no update) before "
                            f"stopping (default: {DEFAULTS.skip_nonfinite}: stop at the first)")
    mark_defaults(parser, OPEN_DESTS)


def left_open(args: argparse.Namespace) -> tuple[str, ...]:
    """The recipe flags of `OPEN_DESTS` not given: the job's workload fills them with its values for its data."""
    return tuple(dest for dest in OPEN_DESTS if (value := getattr(args, dest)) is None or is_default(value))


def recipe_config(args: argparse.Namespace) -> RecipeConfig:
    """The validated recipe of parsed arguments (with the training group's `--lr`)."""
    return RecipeConfig(lr=args.lr, lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                        min_lr=args.min_lr, decay_steps=args.decay_steps, weight_decay=args.weight_decay,
                        grad_clip=None if args.grad_clip == NO_CLIP else args.grad_clip, skip_nonfinite=args.skip_nonfinite)
