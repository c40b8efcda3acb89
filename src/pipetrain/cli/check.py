"""`pipetrain check`: does a layout train like the unsplit model? A few steps of both, compared block by block.
With `--against transformers`: do pipetrain's blocks compute what transformers' class computes on a model folder?"""

from __future__ import annotations

import argparse

from pipetrain.check import DEFAULT_LR, DEFAULT_STEPS, TOLERANCES, run_check
from pipetrain.check.against import against_transformers
from pipetrain.check.run import check_batches
from pipetrain.cli.flag_fields import from_flags
from pipetrain.cli.model_args import add_model_arguments, add_workload_arguments, model_fields
from pipetrain.cli.parallel_args import add_parallel_arguments, cost_balanced, parallel_config
from pipetrain.errors import ConfigError
from pipetrain.pipeline.precision import PRECISIONS
from pipetrain.train.config import SYNTHETIC, TrainConfig, load_data
from pipetrain.train.prepare import check_model

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tol = ", ".join(f"{p}: loss {t.loss:g}, gradients {t.grad:g}, parameters {t.param:g}"
                    for p, t in TOLERANCES.items())
    parser = subparsers.add_parser(
        "check", help=__doc__, description=f"{__doc__} Exit 0 on PASS, 1 on FAIL, 2 on bad input. Relative "
                                           f"tolerances ({tol}); see docs/check.md.")
    add_parallel_arguments(parser)
    group = parser.add_argument_group("what to check")
    add_workload_arguments(group, data_default=SYNTHETIC, data_help="the batches: the workload's synthetic corpus "
                                                                     "(default), or its real data as `train --data` reads it")
    group.add_argument("--seq-len", type=int, default=None, help="the window, for a workload that has one")
    group.add_argument("--batch-size", type=int, default=8, help="global batch size (default: 8)")
    group.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                       help=f"optimizer steps compared (default: {DEFAULT_STEPS})")
    group.add_argument("--lr", type=float, default=DEFAULT_LR,
                       help=f"plain SGD learning rate on both sides (default: {DEFAULT_LR:g})")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--precision", default="fp32", help=f"{' | '.join(PRECISIONS)} (default: fp32)")
    group.add_argument("--against", choices=("unsplit", "transformers"), default="unsplit",
                       help="the reference: the unsplit model, trained --steps steps beside the layout (default); or "
                            "transformers' class of a --model DIR folder at full size, the logits of one batch "
                            "compared with pipetrain's blocks (the layout flags are not used)")
    add_model_arguments(parser)  # --workload hf --model DIR: check your pretrained model's layout
    return parser


def run(args: argparse.Namespace) -> int:
    synthetic = args.data == SYNTHETIC
    config = from_flags(TrainConfig, args, parallel=parallel_config(args), epochs=1, progress=False,
                        train_samples=args.batch_size * max(args.steps, 1) if synthetic else None,
                        test_samples=args.batch_size if synthetic else None, **model_fields(args))
    check_model(config)
    if args.against == "transformers":
        return _against_transformers(config)
    config = cost_balanced(config, args, launched=False)
    train, _ = load_data(config)
    report = run_check(config, train, steps=args.steps, lr=args.lr)
    print("\n".join(report.lines()), flush=True)
    return 0 if report.passed else 1


def _against_transformers(config: TrainConfig) -> int:
    if config.workload != "hf" or config.model_dir is None:
        raise ConfigError(f"--against transformers compares a Hugging Face model folder, not workload "
                          f"{config.workload!r}{'' if config.model_dir else ' without --model'}",
                          hint="pass --workload hf --model DIR")
    train, _ = load_data(config)
    ids = check_batches(config, train, 1)[0][0]
    report = against_transformers(config.model(), ids[0] if isinstance(ids, tuple) else ids)
    print("\n".join(report.lines()), flush=True)
    return 0 if report.passed else 1
