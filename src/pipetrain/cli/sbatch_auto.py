"""`pipetrain sbatch --layout auto`: choose the job's layout now, for the nodes × ranks per node it asks for, and
write the chosen flags into the script (the job runs that layout as given; every rank gets it from the script)."""

from __future__ import annotations

import argparse
import logging

from pipetrain.cli.layout_args import is_default, resolve_layout
from pipetrain.errors import ConfigError

__all__ = ["choose_for_script"]

log = logging.getLogger("pipetrain")

#: `pipetrain train` flags --layout auto consumes (each takes one value); the script gets the chosen layout instead.
_CONSUMED = ("--layout", "--pp", "--dp", "--dp-mode", "--schedule", "--chunks", "--n-microbatches", "--checkpoint",
             "--stages-per-rank", "--balance", "--partition", "--profile", "--calibration", "--nproc", "--mem-cap",
             "--layout-prediction")


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        elif not any(item.startswith(flag + "=") for flag in flags):
            out.append(item)
    return out


def choose_for_script(args: argparse.Namespace, train_argv: list[str], *, ranks_per_node: int) -> list[str]:
    """Resolve `--layout auto` for `args.nodes` × `ranks_per_node` ranks; sets `args.dp`, `.pp`, `.schedule`,
    `.chunks` (which the script renders) and returns the rest of `train_argv` with the chosen flags."""
    from pipetrain.cli import train as train_verb  # the train parser and its configuration

    root = argparse.ArgumentParser(prog="pipetrain")
    train_verb.add_parser(root.add_subparsers(dest="verb"))
    try:
        targs = root.parse_args(["train", *train_argv, "--layout", "auto"])
    except SystemExit:
        raise ConfigError(f"the arguments after -- are not valid `pipetrain train` flags: {' '.join(train_argv)!r}",
                          hint="run `pipetrain train --help`") from None
    for name in ("dp", "pp", "schedule", "chunks"):  # sbatch's own layout flags, when given, fix those choices
        value = getattr(args, name)
        if value is not None and not is_default(value):
            setattr(targs, name, value)
    world = args.nodes * ranks_per_node
    targs.nproc = world
    from pipetrain.cli.device_args import device_choice

    choice = resolve_layout(targs, None, model=lambda a: train_verb._config(a).model(),
                            device=args.device or ("cuda" if args.gpus_per_node else device_choice(targs)),
                            ranks_per_node=ranks_per_node)
    lay = choice.prediction.layout
    args.dp, args.pp, args.schedule, args.chunks = lay.dp, lay.pp, lay.schedule, lay.chunks
    rest = _without(list(train_argv), _CONSUMED)
    rest += ["--dp-mode", lay.dp_mode, "--checkpoint", lay.checkpoint]
    if targs.stages_per_rank:
        rest += ["--stages-per-rank", str(targs.stages_per_rank)]
    if targs.balance:
        rest += ["--balance", ",".join(map(str, targs.balance))]
    step_s, mem_mb = targs.layout_prediction
    return rest + ["--layout-prediction", f"{step_s:.4f},{mem_mb:.0f}"]

