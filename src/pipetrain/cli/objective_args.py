"""The objective flags of `pipetrain train`, `eval` and `data show` (`--objective`; DPO's `--dpo-loss`, `--dpo-beta`,
`--label-smoothing`, `--simpo-gamma`; GRPO's `--reward`, `--num-generations`, `--grpo-iterations`, `--grpo-loss`,
`--kl-beta`, `--epsilon`, `--max-completion-length`, `--temperature`, `--top-p`) and the settings they make (None for
the next-token objective)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pipetrain.errors import ConfigError
from pipetrain.objectives.names import DPO_LOSSES, GRPO_LOSSES

if TYPE_CHECKING:
    from pipetrain.objectives import DPOSettings, GRPOSettings

__all__ = ["OBJECTIVES", "add_objective_arguments", "objective_settings", "check_objective_flags"]

#: `--objective`: the workload's own loss (next-token for a language model), or DPO on preference pairs
OBJECTIVES = ("next-token", "dpo", "grpo")
_DPO_FLAGS = (("--dpo-loss", "dpo_loss", "sigmoid"), ("--dpo-beta", "dpo_beta", 0.1),
              ("--label-smoothing", "label_smoothing", 0.0), ("--simpo-gamma", "simpo_gamma", 0.5))
_GRPO_FLAGS = (("--reward", "reward", None), ("--num-generations", "num_generations", 8),
               ("--grpo-iterations", "grpo_iterations", 1), ("--grpo-loss", "grpo_loss", "dapo"),
               ("--kl-beta", "kl_beta", 0.0), ("--epsilon", "epsilon", 0.2),
               ("--max-completion-length", "max_completion_length", 64), ("--temperature", "temperature", 1.0),
               ("--top-p", "top_p", 1.0))


def add_objective_arguments(parser: argparse.ArgumentParser, *, default: str | None = "next-token") -> None:
    """The objective flags; `default` None: `--objective` unset unless given (eval: the checkpoint's)."""
    group = parser.add_argument_group("objective", "what a step optimises (docs/alignment.md)")
    group.add_argument("--objective", choices=OBJECTIVES, default=default,
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
    group.add_argument("--reward", action="append", default=None, metavar="MODULE:FUNCTION",
                       help="grpo: a reward function f(prompts, completions, **row fields) -> floats, TRL's "
                            "signature (repeat for several; their rewards add up)")
    group.add_argument("--num-generations", type=int, default=8, metavar="G",
                       help="grpo: completions per prompt; --batch-size counts completions (default: 8)")
    group.add_argument("--grpo-iterations", type=int, default=1, metavar="N",
                       help="grpo: optimizer steps per generation batch, TRL's num_iterations (default: 1)")
    group.add_argument("--grpo-loss", choices=GRPO_LOSSES, default="dapo",
                       help="grpo: TRL's loss_type, dapo (per token of the batch) or grpo (per completion) "
                            "(default: dapo, TRL's)")
    group.add_argument("--kl-beta", type=float, default=0.0, metavar="B",
                       help="grpo: KL coefficient to the base model (needs --lora-rank) (default: 0)")
    group.add_argument("--epsilon", type=float, default=0.2, help="grpo: the ratio's clip range (default: 0.2)")
    group.add_argument("--max-completion-length", type=int, default=64, metavar="N",
                       help="grpo: new tokens per completion (default: 64)")
    group.add_argument("--temperature", type=float, default=1.0, help="grpo: sampling temperature (default: 1.0)")
    group.add_argument("--top-p", type=float, default=1.0, help="grpo: nucleus sampling mass (default: 1.0)")


def _refuse(args: argparse.Namespace, flags: tuple, objective: str, what: str) -> None:
    given = [flag for flag, dest, default in flags if getattr(args, dest, default) != default]
    if given:
        raise ConfigError(f"{given[0]} applies to {what}, but --objective {objective} is not given",
                          hint=f"pass --objective {objective} with {given[0]}, or drop {given[0]}")


def check_objective_flags(args: argparse.Namespace) -> str:
    """The objective of the parsed flags (a word of `OBJECTIVES`); a DPO or GRPO flag without its `--objective` is
    refused (no torch: the command line says it before its heavy imports)."""
    objective = getattr(args, "objective", None) or "next-token"
    if objective != "dpo":
        _refuse(args, _DPO_FLAGS, "dpo", "preference pairs")
    if objective != "grpo":
        _refuse(args, _GRPO_FLAGS, "grpo", "GRPO's rollouts")
    return objective


def objective_settings(args: argparse.Namespace) -> DPOSettings | GRPOSettings | None:
    """The objective of the parsed flags; a DPO or GRPO flag without its `--objective` is refused."""
    from pipetrain.objectives import DPOSettings, GRPOLossSettings, GRPOSettings  # torch: not at import

    objective = check_objective_flags(args)
    if objective == "next-token":
        return None
    if objective == "grpo":
        loss = GRPOLossSettings(loss=args.grpo_loss, epsilon=args.epsilon, kl_beta=args.kl_beta,
                                temperature=args.temperature)
        return GRPOSettings(rewards=tuple(args.reward or ()), generations=args.num_generations,
                            iterations=args.grpo_iterations, max_completion_length=args.max_completion_length,
                            top_p=args.top_p, loss=loss)
    return DPOSettings(loss=args.dpo_loss, beta=args.dpo_beta, label_smoothing=args.label_smoothing,
                       simpo_gamma=args.simpo_gamma)
