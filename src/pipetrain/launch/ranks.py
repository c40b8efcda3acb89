"""Who a process is in a job: its place in the cluster (`ClusterEnv`, read from the environment by `env`), the
identity a rank is started with (`RankSpec`), and when this process started."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["ClusterEnv", "RankSpec", "process_start_s", "mark_command_start", "launch_start_s"]


@dataclass(frozen=True)
class ClusterEnv:
    """The position of one process in a job: global and per-node ranks, and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    source: Literal["torchrun", "slurm", "mpi"]

    @property
    def one_task_per_node(self) -> bool:
        """True when each node runs a single process (Slurm `--ntasks-per-node=1` pattern)."""
        return self.local_world_size == 1 and self.world_size == self.num_nodes

    def torch_environ(self) -> dict[str, str]:
        """The variables `torch.distributed.init_process_group(init_method="env://")` reads, for this rank."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


@dataclass(frozen=True)
class RankSpec:
    """Where a spawned rank sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    #: the device type chosen for the job ("cpu" or "cuda"; None: PIPETRAIN_DEVICE, else CUDA when present)
    device: str | None = None
    #: hosts the job spans (more than one: the collectives bind to the interface that reaches `master_addr`)
    nodes: int = 1
    #: when the job's command began (boot-clock seconds; set by `spawn`, whose ranks are forked with their imports
    #: done: its launcher's start, or a later command's in the same process): the start of the job's start-up.
    #: None: this rank's own process start
    launched_at: float | None = None


def process_start_s() -> float | None:
    """When this process started, in seconds of the boot clock (Linux: /proc/self/stat), None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


#: When this process's current command began (boot clock), once a command or job has run in it before; None: its
#: first, which began with the process. `_launched`: a job was launched since that beginning.
_command_start: float | None = None
_launched = False


def mark_command_start() -> None:
    """A command begins now in this process (`pipetrain.cli.main`). The first begins with the process (its
    interpreter start and imports belong to its start-up); a later one (tests and notebooks call `main` or launch
    jobs again in one process) begins now, so that its start-up is not counted from the process's start."""
    global _command_start, _launched
    if _launched:
        try:
            _command_start = time.clock_gettime(time.CLOCK_BOOTTIME)
        except AttributeError:  # no boot clock here: no start-up age either
            _command_start = None
        _launched = False


def launch_start_s() -> float | None:
    """When the job launched now began (boot clock): its command's beginning (`mark_command_start`); a job launched
    again without a new command (the Python API) begins now."""
    global _launched
    mark_command_start()
    _launched = True
    return process_start_s() if _command_start is None else _command_start
