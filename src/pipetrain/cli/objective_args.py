"""The objective flags (`--objective`, `--dpo-loss`, `--dpo-beta`, `--label-smoothing`, `--simpo-gamma`) of `pipetrain
train`, `eval` and `data show`, and the settings they make (None for the next-token objective)."""

from __future__ import annotations

import argparse

from pipetrain.errors import ConfigError
from pipetrain.objectives import DPO_LOSSES, DPOSettings

__all__ = ["OBJECTIVES", "add_objective_arguments", "objective_settings"]

#: `--objective`: the workload's own loss (next-token for a language model), or DPO on preference pairs
OBJECTIVES = ("next-token", "dpo")
_DPO_FLAGS = (("--dpo-loss", "dpo_loss", "sigmoid"), ("--dpo-beta", "dpo_beta", 0.1),
              ("--label-smoothing", "label_smoothing", 0.0), ("--simpo-gamma", "simpo_gamma", 0.5))


def add_objective_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("objective", "what a step optimises (docs/alignment.md)")
    group.add_argument("--objective", choices=OBJECTIVES, default="next-token",
                       help="next-token: the workload's loss; dpo: preference pairs (TRL's prompt/chosen/rejected "
                            "rows, --batch-size counts pairs) against the starting model (default: next-token)")
    group.add_argument("--dpo-loss", choices=DPO_LOSSES, default="sigmoid",
                       help="TRL's DPOTrainer loss_type sigmoid, robust or ipo, or SimPO (reference-free, TRL's "
                            "CPOTrainer) (default: sigmoid)")
    group.add_argument("--dpo-beta", type=float, default=0.1, metavar="B", help="beta (IPO's tau) (default: 0.1)")
    group.add_argument("--label-smoothing", type=float, default=0.0, metavar="EPS",
                       help="the probability a pair's label is flipped, for --dpo-loss robust and simpo (default: 0)")
    group.add_argument("--simpo-gamma", type=float, default=0.5, metavar="G",
                       help="SimPO's target reward margin (default: 0.5)")


def objective_settings(args: argparse.Namespace) -> DPOSettings | None:
    """The objective of the parsed flags; a DPO flag without `--objective dpo` is refused."""
    if getattr(args, "objective", "next-token") != "dpo":
        given = [flag for flag, dest, default in _DPO_FLAGS if getattr(args, dest, default) != default]
        if given:
            raise ConfigError(f"{given[0]} applies to preference pairs, but --objective dpo is not given",
                              hint=f"pass --objective dpo with {given[0]}, or drop {given[0]}")
        return None
    return DPOSettings(loss=args.dpo_loss, beta=args.dpo_beta, label_smoothing=args.label_smoothing,
                       simpo_gamma=args.simpo_gamma)
