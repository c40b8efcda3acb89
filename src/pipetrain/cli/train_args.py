"""`pipetrain train`'s flags, parsed once into the job description (`describe`), and the description written back
as the flags of a file `--config` reads (`config_text`): `--print-config` and the run folder's config.toml."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from pipetrain.cli.config_file import effective_config
from pipetrain.cli.durable_args import durable_config
from pipetrain.cli.flag_fields import from_flags
from pipetrain.cli.layout_args import flag_layout
from pipetrain.cli.log_args import log_config
from pipetrain.cli.lora_args import lora_settings
from pipetrain.cli.model_args import model_fields
from pipetrain.cli.objective_args import objective_settings
from pipetrain.cli.parallel_args import parallel_config
from pipetrain.cli.recipe_args import left_open, recipe_config
from pipetrain.train.config import LayoutRequest, TrainConfig

__all__ = ["describe", "config_text"]


def describe(args: argparse.Namespace) -> TrainConfig:
    """The job description of `pipetrain train`'s parsed flags (after `--config FILE`), validated as far as it goes
    without the model, the data or the machine (`pipetrain.train.prepare` does the rest). Nothing is written into
    `args`; with `--layout auto` the layout is a one-rank placeholder until `prepare` chooses it."""
    parallel, fixed, resize = flag_layout(args)
    request = LayoutRequest(auto=args.layout == "auto", fixed=fixed, on_resize=resize, nproc=args.nproc,
                            calibration=args.calibration, profile=args.profile, mem_cap=args.mem_cap)
    config = from_flags(TrainConfig, args, parallel=parallel, layout=request,
                        recipe=recipe_config(args), progress=not args.no_progress and sys.stderr.isatty(),
                        durable=durable_config(args), logs=log_config(args), lora=lora_settings(args),
                        objective=objective_settings(args),
                        **model_fields(args))
    defaults = config.task().recipe_defaults(synthetic=config.synthetic, max_steps=config.max_steps)
    if chosen := {dest: value for dest, value in defaults.items() if dest in left_open(args)}:  # the workload's
        config = replace(config, recipe=replace(config.recipe, **chosen))  # recipe for its data, where flags are silent
    return replace(config, logs=replace(config.logs, config_text=config_text(args, config)))


def _settled(args: argparse.Namespace, config: TrainConfig) -> dict[str, Any]:
    """The flags (dest -> value) whose values the description settled where the flags left them open."""
    flags: dict[str, Any] = {name: getattr(config, name) for name in ("epochs", "bucket", "seq_len")
                             if getattr(config, name) is not None}  # the defaults of the data
    flags.update({dest: getattr(config.recipe, dest) for dest in left_open(args)})  # the workload's recipe
    relaid = (args.layout != "auto" and getattr(args, "on_resize", None) == "auto"
              and config.parallel != parallel_config(args))  # --on-resize auto: the planner changed the flags' layout
    planned = args.layout == "auto" or relaid
    if planned and not config.layout.auto:  # chosen: the run's configuration is the layout it ran
        parallel, pipeline = config.parallel, config.parallel.pipeline
        flags.update(layout="manual", pp=pipeline.pp, dp=parallel.dp, dp_mode=parallel.dp_mode,
                     schedule=pipeline.schedule, chunks=pipeline.n_microbatches, checkpoint=pipeline.checkpoint,
                     recompute_unit=pipeline.recompute_unit, recompute_every=pipeline.recompute_every,
                     selective_matmuls=pipeline.selective_matmuls,
                     offload_activations=pipeline.offload_activations, fsdp_reshard=parallel.fsdp_reshard,
                     dp_shard=parallel.dp_shard,
                     stages_per_rank=pipeline.stages_per_rank, balance=pipeline.balance, partition=None, profile=None,
                     mem_cap=None, layout_prediction=config.logs.predicted, on_resize=None)
    return flags


def config_text(args: argparse.Namespace, config: TrainConfig) -> str:
    """The configuration of the job `config`, parsed from `args`, as a file `--config` reads: the flags as given,
    with what the description settled that they left open (the window, the epochs and bucketing its data defaults
    to; the layout `--layout auto` chose, and its prediction)."""
    if not hasattr(args, "config_parser"):  # not parsed by `apply_config_file`: no file to write
        return ""
    return effective_config(argparse.Namespace(**{**vars(args), **_settled(args, config)}))
