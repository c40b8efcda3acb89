"""The LoRA flags of `pipetrain train` (`--lora-rank`, `--lora-alpha`, `--lora-dropout`, `--lora-targets`) and the
`LoraSettings` they make (None without `--lora-rank`: every parameter trains)."""

from __future__ import annotations

import argparse

from pipetrain.errors import ConfigError
from pipetrain.lora.config import LoraSettings

__all__ = ["add_lora_arguments", "lora_settings"]


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters", "PEFT's LoRA layers on a frozen base (--workload hf; needs "
                                                       "pipetrain[lora]; docs/lora.md)")
    group.add_argument("--lora-rank", type=int, default=None, metavar="R",
                       help="train PEFT's LoRA adapters of rank R on a frozen base instead of every parameter "
                            "(default: off)")
    group.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                       help="the adapters' scale is A / R (default: 2R)")
    group.add_argument("--lora-dropout", type=float, default=0.0, metavar="P",
                       help="dropout on the adapters' input (default: 0)")
    group.add_argument("--lora-targets", default=None, metavar="NAME,NAME",
                       help="the modules that get an adapter, by name (default: the model family's attention and MLP "
                            "projections, e.g. q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj); "
                            "module.parameter adapts a parameter itself (a MoE router's gate.weight, fused "
                            "experts.gate_up_proj and experts.down_proj)")


def lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    """The `LoraSettings` of the parsed flags; a LoRA flag without `--lora-rank` is refused."""
    rank = getattr(args, "lora_rank", None)
    if rank is None:
        given = [flag for flag, dest, default in (("--lora-alpha", "lora_alpha", None), ("--lora-dropout",
                 "lora_dropout", 0.0), ("--lora-targets", "lora_targets", None)) if getattr(args, dest, default) != default]
        if given:
            raise ConfigError(f"{given[0]} applies to LoRA adapters, but --lora-rank is not given",
                              hint=f"pass --lora-rank 8 (for example) with {given[0]}, or drop {given[0]}")
        return None
    return LoraSettings(rank=rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                        targets=tuple(t.strip() for t in (args.lora_targets or "").split(",") if t.strip()))
