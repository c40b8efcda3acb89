"""`pipetrain sbatch --layout auto`: choose the job's layout now, for the nodes × ranks per node it asks for, on the
description of the script's training command (what `pipetrain train` prepares), and write the chosen layout's flags
into the script (the job runs that layout as given; every rank gets it from the script)."""

from __future__ import annotations

import argparse
import logging

from pipetrain.cli.config_file import apply_config_file
from pipetrain.cli.layout_args import is_default
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError

__all__ = ["choose_for_script"]

log = logging.getLogger("pipetrain")

#: `pipetrain train` flags --layout auto consumes (each takes one value); the script gets the chosen layout instead.
_CONSUMED = ("--layout", "--pp", "--dp", "--dp-mode", "--dp-shard", "--fsdp-reshard", "--schedule", "--chunks",
             "--n-microbatches", "--checkpoint", "--recompute-unit", "--recompute-every", "--selective-matmuls",
             "--stages-per-rank", "--balance", "--partition", "--profile", "--calibration", "--nproc", "--mem-cap",
             "--layout-prediction", "--ep", "--moe-overlap", "--cp", "--cp-attention")
#: the same, switches (no value)
_SWITCHES = ("--offload-activations",)


def _without(argv: list[str], flags: tuple[str, ...], switches: tuple[str, ...] = ()) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item in flags:
            skip = True
        elif item not in switches and not any(item.startswith(flag + "=") for flag in flags):
            out.append(item)
    return out


def _recompute_flags(pipeline: PipelineConfig) -> list[str]:
    """The chosen recomputation's flags beyond `--checkpoint` (none for the whole-stage default)."""
    flags = [] if pipeline.recompute_unit == "stage" else ["--recompute-unit", pipeline.recompute_unit]
    flags += ["--recompute-every", str(pipeline.recompute_every)] if pipeline.recompute_every > 1 else []
    flags += ["--selective-matmuls", pipeline.selective_matmuls] if pipeline.selective_matmuls != "all" else []
    return flags + (["--offload-activations"] if pipeline.offload_activations else [])


def _expert_flags(parallel: ParallelConfig) -> list[str]:
    """The chosen expert split's flags, with DualPipeV's overlap of its all-to-alls when chosen (none at ep 1), and
    the chosen context split's (none at cp 1)."""
    flags = [] if parallel.ep == 1 else ["--ep", str(parallel.ep)] + (
        ["--moe-overlap", "on"] if parallel.pipeline.moe_overlap else [])
    return flags + (["--cp", str(parallel.cp), "--cp-attention", parallel.cp_attention] if parallel.cp > 1 else [])


def choose_for_script(args: argparse.Namespace, train_argv: list[str], *,
                      ranks_per_node: int) -> tuple[list[str], ParallelConfig]:
    """Resolve `--layout auto` for `args.nodes` × `ranks_per_node` ranks: the rest of `train_argv` with the chosen
    layout's flags, and that layout (whose dp, pp, schedule and chunks the script renders). sbatch's own layout
    flags, when given, fix those choices."""
    from pipetrain.cli import train as train_verb  # the train parser, its description and the calibration
    from pipetrain.cli.device_args import device_choice
    from pipetrain.cli.train_args import describe
    from pipetrain.train.layout import auto_layout

    given = [part for name in ("dp", "pp", "schedule", "chunks")
             if (value := getattr(args, name)) is not None and not is_default(value)
             for part in (f"--{name}", str(value))]
    argv = ["train", *train_argv, *given, "--layout", "auto"]
    root = argparse.ArgumentParser(prog="pipetrain")
    train_verb.add_parser(root.add_subparsers(dest="verb"))
    try:
        targs = root.parse_args(argv)
    except SystemExit:
        raise ConfigError(f"the arguments after -- are not valid `pipetrain train` flags: {' '.join(train_argv)!r}",
                          hint="run `pipetrain train --help`") from None
    targs = apply_config_file(root, argv, targs)  # a --config FILE of the training command counts too
    device = args.device or ("cuda" if args.gpus_per_node else device_choice(targs))
    job = auto_layout(describe(targs), world=args.nodes * ranks_per_node, per_node=ranks_per_node, device=device,
                      launched=False, say=True, calibrate=train_verb._calibrate)
    parallel, pipeline = job.parallel, job.parallel.pipeline
    rest = _without(list(train_argv), _CONSUMED, _SWITCHES) + ["--dp-mode", parallel.dp_mode,
                                                                "--checkpoint", pipeline.checkpoint]
    rest += _recompute_flags(pipeline)
    if parallel.dp_mode == "hsdp":  # a node's ranks shard, the nodes replicate: the shard group goes with the mode
        rest += ["--dp-shard", str(parallel.dp_shard)]
    if parallel.fsdp_reshard != "never":
        rest += ["--fsdp-reshard", str(parallel.fsdp_reshard)]
    rest += _expert_flags(parallel)
    if pipeline.stages_per_rank:
        rest += ["--stages-per-rank", str(pipeline.stages_per_rank)]
    if pipeline.balance:
        rest += ["--balance", ",".join(map(str, pipeline.balance))]
    step_s, mem_mb = job.logs.predicted
    return rest + ["--layout-prediction", f"{step_s:.4f},{mem_mb:.0f}"], parallel
