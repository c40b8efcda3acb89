"""The `pipetrain sbatch` verb: render a Slurm batch script that runs `pipetrain train` on every rank."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pipetrain.config import SCHEDULES
from pipetrain.errors import ConfigError
from pipetrain.launch.env import DEVICES
from pipetrain.cli.flag_fields import from_flags
from pipetrain.cli.layout_args import is_default, mark_defaults
from pipetrain.launch.node_range import parse_nodes
from pipetrain.launch.sbatch import (DEFAULT_CPUS_PER_GPU, DEFAULT_WARN_SECONDS, LAUNCHERS, SbatchRequest,
                                     render_sbatch)

__all__ = ["add_parser", "run"]

log = logging.getLogger(__name__)

_EPILOG = """\
Arguments after `--` go to `pipetrain train` unchanged, e.g.
  pipetrain sbatch --nodes 2 --gpus-per-node 4 --pp 4 --dp 2 --output job.sh -- --preset tiny --epochs 1
The script runs `<this python> -m pipetrain train`, so it works from the same virtual environment.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `sbatch` verb and its flags."""
    parser = subparsers.add_parser(
        "sbatch",
        help="write a Slurm batch script for a training run",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job = parser.add_argument_group("resources")
    job.add_argument("--nodes", type=_node_count, default=1,
                     help="nodes to allocate: N, or MIN-MAX (Slurm's syntax: a job that Slurm may start, and requeue "
                          "after a node failure, on MIN to MAX nodes; one task per node, the ranks choose their "
                          "layout at each start; needs --save-dir and --profile after --) (default 1)")
    job.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node; 0 renders a CPU job (default)")
    job.add_argument(
        "--ntasks-per-node",
        type=int,
        default=None,
        help="Slurm tasks per node (default: one per GPU, or dp*pp/nodes on CPU, or 1 with --one-task-per-node)",
    )
    job.add_argument("--cpus-per-task", type=int, default=None,
                     help="CPU cores per task (default: --cpus-per-gpu per GPU of the task; 1 on CPU)")
    job.add_argument("--cpus-per-gpu", type=int, default=DEFAULT_CPUS_PER_GPU,
                     help=f"CPU cores asked per GPU when --cpus-per-task is not given (default {DEFAULT_CPUS_PER_GPU})")
    job.add_argument("--warn-seconds", type=int, default=DEFAULT_WARN_SECONDS,
                     help=f"ask Slurm for SIGUSR1 this long before the time limit: save, stop, requeue "
                          f"(default {DEFAULT_WARN_SECONDS})")
    job.add_argument("--time", default="01:00:00", help="wall-clock limit HH:MM:SS (default 01:00:00)")
    job.add_argument("--partition", default=None, help="Slurm partition")
    job.add_argument("--account", default=None, help="Slurm account (project allocation)")
    job.add_argument("--job-name", default="pipetrain", help="job name (default pipetrain)")
    job.add_argument("--log", default="%x-%j.out", help="stdout+stderr file pattern (default %%x-%%j.out)")
    job.add_argument(
        "--one-task-per-node",
        action="store_true",
        help="one Slurm task per node that spawns the node's ranks (default: one task per rank)",
    )
    job.add_argument("--ranks-per-node", type=int, default=None, help="ranks each node spawns with --one-task-per-node")
    job.add_argument("--device", choices=DEVICES, default=None,
                     help="pin every rank to this device type: the script exports PIPETRAIN_DEVICE (default: cuda "
                          "with --gpus-per-node, else cpu)")
    job.add_argument("--launcher", choices=LAUNCHERS, default="srun",
                     help="what starts the tasks: srun (default) or Open MPI's mpirun (the Horovod way)")
    mesh = parser.add_argument_group("training layout (appended to the training command)")
    mesh.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    mesh.add_argument("--pp", type=int, default=1, help="pipeline ranks (default 1)")
    mesh.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel ranks, within one node (default 1; with --dp > 1 pass --dp-mode fsdp after --)")
    mesh.add_argument("--schedule", choices=tuple(SCHEDULES), default=None, help="pipeline schedule")
    mesh.add_argument("--chunks", type=int, default=None, help="micro-batches per batch")
    mesh.add_argument("--layout", choices=("manual", "auto"), default="manual",
                      help="auto: choose dp, pp, schedule, chunks, recomputation and balance now, for nodes x ranks "
                           "per node and the training flags after -- (see `pipetrain train --layout auto`); the "
                           "flags given here or after -- constrain it (default: manual)")
    mark_defaults(parser, ("dp", "pp"))
    out = parser.add_argument_group("script")
    out.add_argument("--setup", default=None, help="one shell line run before srun, e.g. 'module load pytorch'")
    out.add_argument("--python", default=sys.executable, help="interpreter the job runs (default: this one)")
    out.add_argument("--output", "-o", type=Path, default=None, help="write the script here (default: stdout)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then arguments for `pipetrain train`")
    return parser


def run(args: argparse.Namespace) -> int:
    """Render the script and write it to --output or stdout; returns the exit code."""
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    elif train_args:
        raise ConfigError(
            f"unexpected arguments {' '.join(train_args)!r}",
            hint="put arguments meant for `pipetrain train` after `--`",
        )
    low, high = parse_nodes(args.nodes)
    args = argparse.Namespace(**{**vars(args), "nodes": high})
    layout: dict = {"min_nodes": low if low < high else None}  # the layout --layout auto chose, else sbatch's flags
    if low < high:  # the ranks lay themselves out at each start; the layout flags given are its constraints
        args = _one_task_per_node(args, low)
        layout.update({name: None for name in ("dp", "pp") if is_default(getattr(args, name))})
    elif args.layout == "auto":
        from pipetrain.cli.sbatch_auto import choose_for_script

        train_args, chosen = choose_for_script(args, train_args, ranks_per_node=_ranks_per_node(args))
        layout = dict(dp=chosen.dp, pp=chosen.pipeline.pp, schedule=chosen.pipeline.schedule,
                      chunks=chosen.pipeline.n_microbatches)
    ranks = (layout.get("dp", args.dp) or 1) * (layout.get("pp", args.pp) or 1)
    request = from_flags(SbatchRequest, args, **layout, output=args.log, tasks_per_node=_tasks_per_node(args, ranks),
                         command=[str(Path(args.python).absolute()), "-m", "pipetrain", "train", *train_args])
    script = render_sbatch(request)
    if args.output is None:
        sys.stdout.write(script)
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(script)
    os.chmod(args.output, 0o755)
    log.info("wrote %s (%d ranks on %d node(s)); submit with: sbatch %s", args.output, request.world_size,
             request.nodes, args.output)
    return 0


def _one_task_per_node(args: argparse.Namespace, low: int) -> argparse.Namespace:
    """`args` of a node range as one task per node spawning the node's ranks (--ntasks-per-node: its ranks)."""
    if args.one_task_per_node:
        return args
    ranks = _ranks_per_node(args, f"--nodes {low}-{args.nodes}")
    log.info("pipetrain: --nodes %d-%d: one task per node spawning %d ranks (a requeued job keeps its task count, "
             "so one task per rank could not start on fewer nodes)", low, args.nodes, ranks)
    return argparse.Namespace(**{**vars(args), "one_task_per_node": True, "ranks_per_node": ranks,
                                 "ntasks_per_node": None})


def _node_count(text: str) -> int | str:
    """`--nodes`: a count stays an int (as before ranges existed); a MIN-MAX range stays text, read by
    `parse_nodes` (which names a bad value)."""
    return int(text) if text.strip().isdigit() else text


def _ranks_per_node(args: argparse.Namespace, what: str = "sbatch --layout auto") -> int:
    """The ranks on each node of the job (before --layout auto has chosen dp x pp)."""
    if args.ranks_per_node is not None:
        return int(args.ranks_per_node)
    if args.gpus_per_node > 0:
        return int(args.gpus_per_node)
    if args.ntasks_per_node is not None and not args.one_task_per_node:
        return int(args.ntasks_per_node)
    raise ConfigError(f"{what} on CPU nodes needs the ranks per node",
                      hint="pass --ntasks-per-node N (or --gpus-per-node G for a GPU job)")


def _tasks_per_node(args: argparse.Namespace, ranks: int) -> int:
    """The --ntasks-per-node default: 1 task per node, one per GPU, or the job's `ranks` spread over the nodes."""
    if args.ntasks_per_node is not None:
        return int(args.ntasks_per_node)
    if args.one_task_per_node:
        return 1
    if args.gpus_per_node > 0:
        return int(args.gpus_per_node)
    return max(1, ranks // max(1, args.nodes))
