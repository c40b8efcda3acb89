"""What a Slurm batch job asks for, validated: nodes, tasks, GPUs, CPUs, time, launcher and the training command
(rendered into a script by `pipetrain.launch.sbatch`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.env import DEVICE_VARIABLE, DEVICES
from pipetrain.launch.node_range import RANGE_OWNED, check_range, range_flags

__all__ = ["SbatchRequest", "DEFAULT_CPUS_PER_GPU", "DEFAULT_WARN_SECONDS", "LAUNCHERS"]

#: What starts the tasks in the script: Slurm's srun, or Open MPI's mpirun (which reads the allocation itself).
LAUNCHERS = ("srun", "mpirun")

#: CPU cores asked per GPU when --cpus-per-task is not given (clusters such as Jean Zay give ~10 per GPU).
DEFAULT_CPUS_PER_GPU = 10
#: Seconds before the time limit at which Slurm sends SIGUSR1: the job saves, stops and requeues itself.
DEFAULT_WARN_SECONDS = 120

_TIME = re.compile(r"(?:(\d+)-)?(\d{1,3}):([0-5]\d):([0-5]\d)")
_PLAIN = re.compile(r"[A-Za-z0-9_.,:@%/+=-]+")
#: Field name -> the `pipetrain sbatch` flag that sets it, where they differ.
_FLAGS = {"tasks_per_node": "--ntasks-per-node"}


@dataclass(frozen=True, kw_only=True)
class SbatchRequest:
    """What a batch job asks Slurm for and the training command each task runs.

    One task per rank by default (`tasks_per_node` ranks per node, one GPU each when `gpus_per_node` > 0).
    With `one_task_per_node`, Slurm starts one task per node and pipetrain spawns `ranks_per_node` ranks in
    it (default: one per GPU). `gpus_per_node=0` renders the CPU variant (no ``--gres``).
    With `min_nodes`, the job runs on `min_nodes` to `nodes` nodes (`--nodes=MIN-MAX`) and its ranks choose their
    layout at each start (`pipetrain.launch.node_range`); `dp` and `pp` are then constraints, None when not given.
    """

    command: Sequence[str]
    job_name: str = "pipetrain"
    nodes: int = 1
    #: the fewest nodes the job may run on (Slurm's `--nodes=MIN-MAX`, `nodes` the most); None: exactly `nodes`
    min_nodes: int | None = None
    gpus_per_node: int = 0
    tasks_per_node: int = 1
    cpus_per_task: int | None = None
    cpus_per_gpu: int = DEFAULT_CPUS_PER_GPU
    warn_seconds: int = DEFAULT_WARN_SECONDS
    time: str = "01:00:00"
    dp: int | None = 1
    pp: int | None = 1
    tp: int = 1
    schedule: str | None = None
    chunks: int | None = None
    partition: str | None = None
    account: str | None = None
    output: str = "%x-%j.out"
    error: str | None = None
    setup: str | None = None
    one_task_per_node: bool = False
    ranks_per_node: int | None = None
    #: the device every rank is pinned to (PIPETRAIN_DEVICE in the script); default: cuda with GPUs, else cpu
    device: str | None = None
    #: what starts the tasks: "srun" (default) or "mpirun" (Open MPI, `tasks_per_node` processes on each node)
    launcher: str = "srun"

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(str(a) for a in self.command))
        _check_device(self)
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}",
                              hint="pass --launcher srun (Slurm's) or --launcher mpirun (Open MPI's)")
        if self.min_nodes == self.nodes:
            object.__setattr__(self, "min_nodes", None)  # MIN-MAX with MIN = MAX: a node count
        for name in ("dp", "pp"):
            if getattr(self, name) is None and self.min_nodes is None:
                object.__setattr__(self, name, 1)
        for name in ("nodes", "min_nodes", "tasks_per_node", "dp", "pp", "tp", "cpus_per_gpu", "warn_seconds"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name), minimum=1)
        if self.cpus_per_task is not None:
            _count("cpus_per_task", self.cpus_per_task, minimum=1)
        _count("gpus_per_node", self.gpus_per_node, minimum=0)
        if self.ranks_per_node is not None:
            _count("ranks_per_node", self.ranks_per_node, minimum=1)
        for name in ("job_name", "partition", "account", "output", "error"):
            value = getattr(self, name)
            if value is not None and not _PLAIN.fullmatch(value):
                raise ConfigError(
                    f"{name} {value!r} is empty or has characters other than letters, digits and _.,:@%/+=-",
                    hint=f"use a plain {name.replace('_', ' ')} such as 'pipetrain'",
                )
        if not _TIME.fullmatch(self.time):
            raise ConfigError(
                f"time limit {self.time!r} is not HH:MM:SS", hint="pass --time 01:30:00 (or D-HH:MM:SS)"
            )
        if self.setup is not None and "\n" in self.setup.strip():
            raise ConfigError("the setup line spans several lines", hint="pass one shell line, joined with '&&'")
        if not self.command:
            raise ConfigError("the training command is empty", hint="give the argv of `pipetrain train ...`")
        appended = set(self._layout_flags()[::2]) | (set(RANGE_OWNED) if self.min_nodes is not None else set())
        owned = [a for a in self.command if a.split("=", 1)[0] in appended]
        if owned:
            raise ConfigError(
                f"the training command already sets {', '.join(owned)}",
                hint="pass these to `pipetrain sbatch` itself, not after `--`; they are appended for you",
            )
        self._check_layout()
        if self.min_nodes is not None:
            check_range(self)
            return
        pipeline = PipelineConfig(
            pp=self.pp, schedule=self.schedule or "gpipe", n_microbatches=self.chunks or self.pp
        )
        parallel = ParallelConfig(dp=self.dp, pipeline=pipeline, tp=self.tp, dp_mode="fsdp" if self.tp > 1 else "ddp")
        parallel.check_world(self.world_size)
        parallel.check_nodes(self.local_world_size)  # a tensor-parallel group within one node

    def _check_layout(self) -> None:
        if self.one_task_per_node:
            if self.tasks_per_node != 1:
                raise ConfigError(
                    f"one task per node, but tasks_per_node={self.tasks_per_node}",
                    hint="leave --ntasks-per-node at 1 with --one-task-per-node",
                )
            if self.ranks_per_node is None and not self.gpus_per_node:
                raise ConfigError(
                    "one task per node without GPUs needs the number of ranks each node spawns",
                    hint="pass --ranks-per-node N",
                )
            self._check_gpus(self.local_world_size, "rank", "--ranks-per-node")
            return
        if self.ranks_per_node is not None:
            raise ConfigError(
                "ranks_per_node only applies to one task per node",
                hint="add --one-task-per-node, or set the ranks with --ntasks-per-node",
            )
        self._check_gpus(self.tasks_per_node, "task", "--ntasks-per-node")

    def _check_gpus(self, count: int, what: str, flag: str) -> None:
        """Refuse more processes (`what`: rank or task) per node than the node's GPUs."""
        if self.gpus_per_node and count > self.gpus_per_node:
            raise ConfigError(f"{count} {what}s per node but only {self.gpus_per_node} GPUs per node",
                              hint=f"pass {flag} {self.gpus_per_node} or fewer (one {what} per GPU)")

    @property
    def gpus_per_task(self) -> int:
        """GPUs each Slurm task drives: all of the node's with one task per node, else one (0 on CPU)."""
        if not self.gpus_per_node:
            return 0
        return self.gpus_per_node if self.one_task_per_node else 1

    @property
    def cpus(self) -> int:
        """CPU cores each task asks for: --cpus-per-task, else `cpus_per_gpu` per GPU of the task (on CPU one per rank
        of the task: 1, or the node's ranks for one task per node)."""
        if self.cpus_per_task is not None:
            return self.cpus_per_task
        if not self.gpus_per_node:
            return self.local_world_size if self.one_task_per_node else 1
        return max(1, self.cpus_per_gpu * self.gpus_per_task)

    def cpus_comment(self) -> str:
        """What the CPU request assumed, for the rendered script."""
        if self.cpus_per_task is not None:
            return f"# CPUs: {self.cpus_per_task} per task, as asked (--cpus-per-task)."
        if not self.gpus_per_node:
            return (f"# CPUs: {self.cpus} per task (CPU job: one core per rank of the task; "
                    "change with --cpus-per-task).")
        return (f"# CPUs: {self.cpus} per task = {self.cpus_per_gpu} per GPU x {self.gpus_per_task} GPU(s) per task "
                f"(assumed share of a GPU node; change with --cpus-per-gpu or --cpus-per-task).")

    @property
    def local_world_size(self) -> int:
        """Ranks on each node."""
        if self.one_task_per_node:
            return self.ranks_per_node or self.gpus_per_node
        return self.tasks_per_node

    @property
    def world_size(self) -> int:
        """Ranks in the whole job (on `nodes` nodes: the most, for a node range)."""
        return self.nodes * self.local_world_size

    def train_argv(self) -> list[str]:
        """The command each Slurm task runs: the given argv plus the layout flags of this request."""
        return [*self.command, *self._layout_flags()]

    def _layout_flags(self) -> list[str]:
        if self.min_nodes is not None:
            return range_flags(self)
        flags = ["--dp", str(self.dp), "--pp", str(self.pp)]
        if self.tp > 1:
            flags += ["--tp", str(self.tp)]
        if self.schedule is not None:
            flags += ["--schedule", self.schedule]
        if self.chunks is not None:
            flags += ["--chunks", str(self.chunks)]
        if self.one_task_per_node:
            flags += ["--ranks-per-node", str(self.local_world_size)]
        return flags


def _check_device(req: SbatchRequest) -> None:
    """`device` known and possible on the job's nodes, and not contradicted by a `--device` of the command."""
    if req.device is None:
        object.__setattr__(req, "device", "cuda" if req.gpus_per_node else "cpu")
    if req.device not in DEVICES:
        raise ConfigError(f"device {req.device!r} is not a device type", hint=f"pass --device {' or '.join(DEVICES)}")
    if req.device == "cuda" and not req.gpus_per_node:
        raise ConfigError("--device cuda but the job asks for no GPU (--gpus-per-node 0)",
                          hint="pass --gpus-per-node N, or --device cpu")
    given = [req.command[i + 1] for i, a in enumerate(req.command[:-1]) if a == "--device"]
    given += [a.split("=", 1)[1] for a in req.command if a.startswith("--device=")]
    if any(value != req.device for value in given):
        raise ConfigError(f"the training command sets --device {given[0]} but the job runs on {req.device} "
                          f"({DEVICE_VARIABLE}={req.device} in the script)",
                          hint="pass --device to `pipetrain sbatch` itself, not after `--`")


def _count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{name} must be an integer >= {minimum}, got {value!r}",
            hint=f"pass {_FLAGS.get(name, '--' + name.replace('_', '-'))} {max(minimum, 1)} or more",
        )
