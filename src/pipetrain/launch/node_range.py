"""A batch job on a range of nodes (Slurm's `--nodes MIN-MAX`): what it asks, what it refuses, and how its script
lays the ranks out at each start, so that a job Slurm requeues on fewer nodes after a node failure goes on.

Slurm requeues a batch job (`--requeue`) when one of its nodes fails: the node is set DOWN once its slurmd has not
answered for `SlurmdTimeout`, the job is killed on the others and held `cred_expire` + 1 s, then it starts again on
the nodes there are, between MIN and MAX. Two things make such a job start on fewer nodes:

- **one Slurm task per node**, no `--ntasks-per-node` directive: Slurm keeps the task count of the first
  allocation in a requeued job (seen with 22.05: `--nodes=1-2 --ntasks-per-node=2`, first run on 2 nodes, requeued
  with `NumTasks=4`, pending for ever on `ReqNodeNotAvail` with one node down); a job of one task per node is
  requeued with one task and runs on the node left. pipetrain spawns the node's ranks in that task;
- **the layout chosen by the ranks at each start** (`--layout auto`, the layout flags given as constraints): a
  requeued run adds `--resume auto --on-resize auto`, goes on from the newest complete checkpoint and says how it
  re-laid itself out (`pipetrain.plan.resize`).
"""

from __future__ import annotations

import re
from typing import Any

from pipetrain.errors import ConfigError

__all__ = ["parse_nodes", "check_range", "range_flags", "range_comment", "RANGE_OWNED"]

_NODES = re.compile(r"(\d+)(?:-(\d+))?")
#: Flags of the training command a node-range script sets itself (the layout at each start, a restart's resume).
RANGE_OWNED = ("--layout", "--on-resize", "--resume")


def parse_nodes(text: str) -> tuple[int, int]:
    """`--nodes N` or `--nodes MIN-MAX` (Slurm's syntax) as (min, max)."""
    found = _NODES.fullmatch(str(text).strip())
    if not found:
        raise ConfigError(f"--nodes {text!r} is neither a node count nor a range MIN-MAX",
                          hint="pass --nodes 2, or --nodes 1-2 for a job that may run (and be requeued) on 1 or 2 nodes")
    low = int(found[1])
    high = int(found[2]) if found[2] is not None else low
    if low < 1 or high < low:
        raise ConfigError(f"--nodes {text}: the range must be 1 <= MIN <= MAX",
                          hint="pass --nodes 1-2, for example")
    return low, high


def _given(argv: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def check_range(req: Any) -> None:
    """The refusals of the job `req` (a `launch.sbatch.SbatchRequest`, which calls this) on `req.min_nodes` to
    `req.nodes` nodes, one message each."""
    span = f"--nodes {req.min_nodes}-{req.nodes}"
    if req.min_nodes > req.nodes:
        raise ConfigError(f"{span}: the minimum is above the maximum", hint=f"pass --nodes {req.nodes}-{req.min_nodes}")
    if not req.one_task_per_node:
        raise ConfigError(f"{span} needs one task per node: a requeued Slurm job keeps the task count of its first "
                          "allocation, so a job of one task per rank could not start again on fewer nodes",
                          hint="add --one-task-per-node (with --ranks-per-node N on CPU nodes)")
    if req.launcher != "srun":
        raise ConfigError(f"{span} with --launcher {req.launcher}: a node range is rendered for srun only",
                          hint="pass --launcher srun, or a node count (--nodes N)")
    if req.tp > 1:
        raise ConfigError(f"{span} with --tp {req.tp}: the ranks of a node range lay themselves out at each start, "
                          "and the planner lays out dp x pp only", hint="drop --tp, or pass a node count (--nodes N)")
    if req.dp is not None and req.pp is not None:
        raise ConfigError(f"{span} with --dp {req.dp} --pp {req.pp}: these fix the job at {req.dp * req.pp} ranks, "
                          f"but it may run on {req.min_nodes * req.local_world_size}",
                          hint="drop --dp (or --pp): the ranks choose it at each start for the nodes they got")
    for nodes in range(req.min_nodes, req.nodes + 1):
        ranks = nodes * req.local_world_size
        for flag, size in (("--pp", req.pp), ("--dp", req.dp)):
            if size is not None and ranks % size:
                raise ConfigError(f"{span}: {flag} {size} does not divide the {ranks} ranks of {nodes} node(s)",
                                  hint=f"pass a {flag} that divides {req.local_world_size} ranks per node times "
                                       f"every node count of the range, or narrow the range")
    command = tuple(req.command)
    if not _given(command, "--save-dir"):
        raise ConfigError(f"{span}: a requeued run resumes from the job's checkpoints, but the training command has "
                          "no --save-dir", hint="add --save-dir DIR (on a file system every node sees) after --")
    if not _given(command, "--profile"):
        raise ConfigError(f"{span}: the ranks lay the job out at each start, from the same block costs on every "
                          "rank, but the training command has no --profile",
                          hint="write one with `pipetrain profile --output FILE` and add --profile FILE (and "
                               "--calibration FILE) after --")


def range_flags(req: Any) -> list[str]:
    """The layout flags of a node-range job: `--layout auto` with the layout flags given as its constraints."""
    flags = ["--layout", "auto"]
    for flag, value in (("--pp", req.pp), ("--dp", req.dp), ("--schedule", req.schedule), ("--chunks", req.chunks)):
        if value is not None:
            flags += [flag, str(value)]
    return flags + ["--ranks-per-node", str(req.local_world_size)]


def range_comment(req: Any) -> list[str]:
    """What a node-range script says about a node failure."""
    if req.min_nodes is None:
        return []
    return [
        "# A node that fails (Slurm sets it DOWN after SlurmdTimeout) requeues the job too (--requeue): it starts",
        f"# again on the {req.min_nodes}-{req.nodes} nodes there are, from the newest complete checkpoint, laid out "
        "for the ranks it has",
        "# (--on-resize auto; docs/long-jobs.md).",
    ]
