"""The flags of `--layout auto` for `train` (and, through it, `sbatch`): the planner chooses pp, dp, dp-mode, schedule,
chunks, recomputation and balance; the layout flags given beside it constrain the search. What they ask becomes the
description's `LayoutRequest`, which `pipetrain.train.prepare` settles (`pipetrain.train.layout`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.cli.parallel_args import parallel_config
from pipetrain.config import ParallelConfig
from pipetrain.errors import ConfigError
from pipetrain.plan.auto import Fixed
from pipetrain.plan.hardware import default_calibration_path
from pipetrain.plan.resize import RESIZE_POLICIES, check_fixed_world

__all__ = ["add_layout_arguments", "explicit_layout", "on_resize", "one_rank", "flag_layout", "mark_defaults",
           "is_default", "LAYOUT_DESTS"]

#: The flags --layout auto chooses (dest names); given on the command line (or in --config), they fix that choice.
LAYOUT_DESTS = ("pp", "dp", "dp_mode", "schedule", "chunks", "checkpoint", "stages_per_rank", "balance", "partition",
                "ep", "cp", "cp_attention", "dp_shard", "moe_overlap")


class _DefaultInt(int):
    """An int default argparse left in place: the flag was not given."""


class _DefaultStr(str):
    """A str default argparse left in place: the flag was not given."""


def mark_defaults(parser: argparse.ArgumentParser, dests: tuple[str, ...] = LAYOUT_DESTS) -> None:
    """Mark the int and str defaults of `dests` in `parser`, so that `is_default` tells a flag not given."""
    for action in parser._actions:
        if action.dest in dests and isinstance(action.default, (int, str)) and not is_default(action.default):
            action.default = (_DefaultStr if isinstance(action.default, str) else _DefaultInt)(action.default)


def is_default(value: object) -> bool:
    """Whether `value` is a default `mark_defaults` marked (the flag was not given)."""
    return isinstance(value, (_DefaultInt, _DefaultStr))


def _prediction(text: str) -> tuple[float, float]:
    try:
        step, mem = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STEP_S,MEM_MB, got {text!r}") from None
    return step, mem


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The group "automatic layout"; call after the parallelism flags are added (it marks their defaults, so that
    the flags a user gives can be told from the defaults)."""
    group = parser.add_argument_group("automatic layout")
    group.add_argument("--layout", choices=("manual", "auto"), default="manual",
                       help="auto: the planner chooses pp, dp, dp-mode, schedule, chunks, recomputation and balance "
                            "for the ranks, global batch and memory; layout flags given with it constrain the search "
                            "(default: manual, the flags as given)")
    group.add_argument("--on-resize", choices=RESIZE_POLICIES, default=None,
                       help="a job resumed (or started by a launcher) with another number of ranks than its checkpoint "
                            "(or its layout flags) has: auto lets the planner lay out the ranks there are, the layout "
                            "flags given staying constraints (needs --profile and --calibration); stop ends it with "
                            "one message (default: auto with --layout auto, else stop; docs/long-jobs.md)")
    group.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="with --layout auto, ranks to spawn here (default: --dp x --pp when given, else the GPUs "
                            "of this node, or 2 on the CPU); a launcher's world size otherwise")
    group.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                       help=f"with --layout auto: device and network figures (default: {default_calibration_path()}; "
                            "measured first, about 30 s, when missing)")
    group.add_argument("--layout-prediction", type=_prediction, default=None, metavar="STEP_S,MEM_MB",
                       help="a predicted step time and rank-0 memory to log the measured ones beside (set by "
                            "`pipetrain sbatch --layout auto`)")
    mark_defaults(parser)


def explicit_layout(args: argparse.Namespace) -> Fixed:
    """The layout choices given as flags (a value still the marked default is not given)."""
    def given(name: str):
        value = getattr(args, name, None)
        return None if value is None or is_default(value) else value

    if given("balance") is not None:
        raise ConfigError(f"--balance {','.join(map(str, args.balance))} fixes the split that --layout auto chooses",
                          hint="drop --balance, or constrain the split with --partition uniform|time")
    partition = given("partition")
    if partition not in (None, "uniform", "time"):
        raise ConfigError(f"--partition {partition} is not a split --layout auto predicts",
                          hint="use --partition uniform or time with --layout auto, or drop it")
    overlap = given("moe_overlap")
    return Fixed(pp=given("pp"), dp=given("dp"), dp_mode=given("dp_mode"), schedule=given("schedule"),
                 chunks=given("chunks"), checkpoint=given("checkpoint"), virtual=given("stages_per_rank"),
                 balance=partition, ep=given("ep"), cp=given("cp"), cp_attention=given("cp_attention"),
                 dp_shard=given("dp_shard"), moe_overlap=None if overlap is None else overlap == "on")


def on_resize(args: argparse.Namespace) -> str:
    """`--on-resize`, defaulted (auto with --layout auto, else stop); an explicit `auto` whose layout flags fix the
    world (both --dp and --pp) is refused: no other number of ranks could be laid out."""
    given = getattr(args, "on_resize", None)
    if given == "auto":
        check_fixed_world(explicit_layout(args), tp=getattr(args, "tp", 1) or 1)
    return given or ("auto" if getattr(args, "layout", "manual") == "auto" else "stop")


def one_rank(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of `args` with a one-rank layout: the job's layout until `--layout auto` has chosen one (the flags it
    does not choose, such as --tp, kept)."""
    return argparse.Namespace(**{**vars(args), "pp": 1, "dp": 1, "dp_mode": "ddp", "schedule": "gpipe", "chunks": 1,
                                 "checkpoint": "never", "stages_per_rank": None, "ep": 1, "cp": 1, "balance": None, "partition": None,
                                 "dp_shard": None, "mem_cap": None, "profile": None, "moe_overlap": "off"})


def flag_layout(args: argparse.Namespace) -> tuple[ParallelConfig, Fixed, str]:
    """The layout the flags ask, validated (no torch): its `ParallelConfig` (with `--layout auto`, a one-rank
    placeholder until the planner chooses), the choices they fix for the planner, and the `--on-resize` policy."""
    auto, resize = args.layout == "auto", on_resize(args)
    fixed = explicit_layout(args) if auto or resize == "auto" else Fixed()
    return parallel_config(one_rank(args) if auto else args), fixed, resize
