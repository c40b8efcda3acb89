"""`pipetrain data show --data FILE --model DIR`: the first samples of your data as the model sees them (its chat
template applied, cut to the window), the tokens the loss trains on marked, with the start-up line's summary."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.cli.model_args import add_pack_arguments, add_row_arguments, row_format
from pipetrain.cli.objective_args import add_objective_arguments, objective_settings
from pipetrain.data.show import show_samples
from pipetrain.errors import ConfigError
from pipetrain.objectives import DPOSettings
from pipetrain.train.config import TrainConfig, load_data

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("data", help=__doc__, description=__doc__)
    verbs = parser.add_subparsers(dest="data_verb", required=True, metavar="{show}")
    show = verbs.add_parser("show", help="print the first samples, trained tokens marked",
                            description=__doc__)
    show.add_argument("--data", type=Path, required=True, metavar="FILE|DIR",
                      help="JSON lines, JSON, Parquet, a folder of them, a datasets folder, or plain text")
    show.add_argument("--model", type=Path, required=True, metavar="DIR",
                      help="the model folder whose tokenizer (and chat template) reads the data")
    show.add_argument("--seq-len", type=int, default=None, help="the window (default: as train's, 128 or the model's)")
    show.add_argument("--rows", type=int, default=3, help="how many samples to print (default: 3)")
    add_pack_arguments(show)
    add_row_arguments(show.add_argument_group("data rows"))
    add_objective_arguments(show)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.rows < 1:
        raise ConfigError(f"--rows {args.rows} shows nothing", hint="pass --rows 1 or more")
    config = TrainConfig(workload="hf", model_dir=args.model, data=args.data, seq_len=args.seq_len, pack=args.pack,
                         row_format=row_format(args), batch_size=1, objective=objective_settings(args))
    from pipetrain.objectives.show import show_pairs
    from pipetrain.workloads.hf.text import load_tokenizer

    train, _ = load_data(config)
    if config.objective is not None and not isinstance(config.objective, DPOSettings):
        raise ConfigError("data show prints training rows and preference pairs; GRPO's rows are prompts",
                          hint="drop --objective grpo (data show --objective dpo shows pairs)")
    show = show_pairs if config.objective is not None else show_samples
    print(show(train, load_tokenizer(args.model), args.rows))
    return 0
