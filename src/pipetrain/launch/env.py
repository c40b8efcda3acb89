"""Cluster environment: where this process's rank comes from (torchrun, mpirun or Slurm variables), read in one place.

This module is the only reader of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*, SLURM_*, OMPI_* and PMI_* (handed to
launch/mpi.py), PIPETRAIN_DEVICE, PIPETRAIN_START_METHOD and the socket-interface variables (GLOO_SOCKET_IFNAME,
NCCL_SOCKET_IFNAME). Each launcher's variables are parsed from the mapping read here by launch/torchrun.py,
launch/slurm.py and launch/mpi.py. It never creates processes; launchers use what `detect` reports, or spawn the
ranks themselves when it reports None.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

from pipetrain.errors import LaunchError
from pipetrain.launch import netif
from pipetrain.launch.nodelist import expand_nodelist, expand_tasks_per_node
from pipetrain.launch.mpi import OPEN_MPI_RANK, PMI_RANK, from_open_mpi, from_pmi
from pipetrain.launch.ranks import ClusterEnv
from pipetrain.launch.slurm import from_slurm, slurm_port, slurm_task
from pipetrain.launch.torchrun import from_torchrun
from pipetrain.launch.variables import integer as _int

__all__ = [
    "ClusterEnv",
    "SOCKET_VARIABLES",
    "JOIN_TIMEOUT_VARIABLE",
    "apply_socket_interface",
    "join_timeout",
    "restore_environ",
    "without_launcher_variables",
    "socket_interface_variables",
    "DEVICE_VARIABLE",
    "DEVICES",
    "START_METHOD_VARIABLE",
    "START_METHODS",
    "start_method",
    "detect",
    "device_override",
    "expand_for_local_ranks",
    "expand_nodelist",
    "expand_tasks_per_node",
    "free_port",
    "slurm_port",
    "slurm_job_id",
    "shared_store_restarts",
    "elastic_restarts_left",
    "under_torchrun_agent",
]

#: The variable a launcher (a job script, a test tier) sets to choose the device of every rank.
DEVICE_VARIABLE = "PIPETRAIN_DEVICE"
#: The device types a run can be pinned to.
DEVICES = ("cpu", "cuda")
#: The variable choosing how local ranks start: forked from a server that imported torch once (default), or
#: each a fresh interpreter (multiprocessing's `spawn`; see launch/forkserver.py).
START_METHOD_VARIABLE = "PIPETRAIN_START_METHOD"
START_METHODS = ("forkserver", "spawn")
#: Seconds a rank of a multi-node job waits for rank 0's host to accept a connection (default 120).
JOIN_TIMEOUT_VARIABLE = "PIPETRAIN_JOIN_TIMEOUT"
_JOIN_TIMEOUT_S = 120.0
#: The variables naming the interface a backend binds to: gloo's, and NCCL's (bootstrap and socket transport).
SOCKET_VARIABLES = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def detect(environ: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """Read the rank layout from torchrun's variables, else from mpirun's (Open MPI, or a PMI launcher such as
    MPICH's Hydra), else from a Slurm step's, else return None.

    None means no launcher placed this process: pipetrain spawns its ranks itself.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return from_torchrun(env)
    if OPEN_MPI_RANK in env:  # before Slurm: mpirun in an allocation starts its daemons with srun
        return from_open_mpi(env)
    if PMI_RANK in env and not slurm_task(env):
        return from_pmi(env)
    if "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return from_slurm(env)
    return None


def device_override(environ: Mapping[str, str] | None = None) -> str | None:
    """The device type PIPETRAIN_DEVICE pins every rank to ("cpu" or "cuda"), or None when unset or empty."""
    env = os.environ if environ is None else environ
    raw = env.get(DEVICE_VARIABLE, "").strip()
    if not raw:
        return None
    if raw.lower() not in DEVICES:
        raise LaunchError(f"{DEVICE_VARIABLE}={raw!r} is not a device type",
                          hint=f"set {DEVICE_VARIABLE} to {' or '.join(DEVICES)}, or unset it")
    return raw.lower()


def start_method(environ: Mapping[str, str] | None = None) -> str:
    """How local ranks start (PIPETRAIN_START_METHOD): "forkserver" (default) or "spawn"."""
    env = os.environ if environ is None else environ
    raw = env.get(START_METHOD_VARIABLE, "").strip().lower()
    if not raw:
        return START_METHODS[0]
    if raw not in START_METHODS:
        raise LaunchError(f"{START_METHOD_VARIABLE}={raw!r} is not a start method",
                          hint=f"set {START_METHOD_VARIABLE} to {' or '.join(START_METHODS)}, or unset it")
    return raw


def expand_for_local_ranks(env: ClusterEnv, ranks_per_node: int) -> list[ClusterEnv]:
    """Turn the one process of a node into `ranks_per_node` ranks: global = node_rank * ranks_per_node + local."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise LaunchError(
            f"ranks per node must be a positive integer, got {ranks_per_node!r}", hint="pass --ranks-per-node 1 or more"
        )
    if not env.one_task_per_node:
        raise LaunchError(
            f"--ranks-per-node needs one task per node, but this job runs {env.local_world_size} task(s) on "
            f"node {env.node_rank} and {env.world_size} task(s) on {env.num_nodes} node(s)",
            hint="launch with --ntasks-per-node=1, or drop --ranks-per-node and run one task per rank",
        )
    return [
        replace(
            env,
            rank=env.node_rank * ranks_per_node + local,
            world_size=env.num_nodes * ranks_per_node,
            local_rank=local,
            local_world_size=ranks_per_node,
        )
        for local in range(ranks_per_node)
    ]


def socket_interface_variables(master_addr: str, *, nodes: int, device_type: str,
                               environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The socket-interface variables to set for a rank of a `nodes`-node job whose rank 0 is on `master_addr`.

    Only variables the user left unset: GLOO_SOCKET_IFNAME always, NCCL_SOCKET_IFNAME on CUDA. The interface is the
    one that routes to `master_addr`; when that address is loopback (this is rank 0's host and its name resolves to
    127.0.x.x) a multi-node job takes the default route's interface and a one-node job sets nothing. Empty when
    nothing is to be set or no interface is found (the backend's own choice stands).
    """
    env = os.environ if environ is None else environ
    names = [SOCKET_VARIABLES["gloo"]] + ([SOCKET_VARIABLES["nccl"]] if device_type == "cuda" else [])
    missing = [name for name in names if not env.get(name, "").strip()]
    if not missing:
        return {}
    if netif.is_loopback(master_addr):
        interface = netif.default_route_interface() if nodes > 1 else None
    else:
        interface = netif.interface_towards(master_addr)
    if interface is None or (interface == "lo" and nodes > 1):
        return {}
    return {name: interface for name in missing}


def apply_socket_interface(master_addr: str, *, nodes: int, device_type: str) -> dict[str, str]:
    """Export what `socket_interface_variables` chooses into this process's environment (read by gloo and NCCL
    when the process group is created); returns what was set."""
    chosen = socket_interface_variables(master_addr, nodes=nodes, device_type=device_type)
    os.environ.update(chosen)
    return chosen


#: What a launcher (torchrun, Slurm) tells its ranks, which ranks spawned by one of them must not inherit.
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                       "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def without_launcher_variables() -> Iterator[None]:
    """Within the block, this process's environment lacks its launcher's rank variables (and torchrun's
    TORCHELASTIC_*): a rank of a multi-node job that spawns a job of its own node (`plan --calibrate`) would else
    pass TORCHELASTIC_USE_AGENT_STORE on, and its spawned rank 0 would wait for torchrun's store instead of
    starting its own (a hang). Restored after the block."""
    names = [n for n in os.environ
             if n in _LAUNCHER_VARIABLES or n.startswith(("TORCHELASTIC_", "SLURM_", "OMPI_COMM_WORLD_", "PMI_"))]
    saved = {name: os.environ.pop(name) for name in names}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextmanager
def restore_environ() -> Iterator[None]:
    """Within the block, the socket-interface variables may be exported (`apply_socket_interface`); after it, they
    are as before (a process that joins a multi-node job and then spawns ranks of its own node)."""
    before = {name: os.environ.get(name) for name in SOCKET_VARIABLES.values()}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --- hang reports (issue 29, part 3): torch's NCCL flight recorder, on for jobs watched by --step-timeout ---
#: The variables that turn torch's flight recorder on (entries kept per process group) and dump it on NCCL's own
#: timeout; set before the process group starts, unless the user set them.
FLIGHT_RECORDER_ENTRIES = 2000


def enable_flight_recorder(dump_prefix: str | None) -> dict[str, str]:
    """Turn torch's flight recorder on in this process (a CUDA job; before its process group starts): the variables
    set, those the user set left alone. `dump_prefix`: where NCCL's own timeout dumps (torch appends the rank)."""
    wanted = {"TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if dump_prefix is not None:
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = dump_prefix
    set_now = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(set_now)
    return set_now


def join_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds to wait for rank 0's host before joining a multi-node job (PIPETRAIN_JOIN_TIMEOUT, default 120)."""
    env = os.environ if environ is None else environ
    raw = env.get(JOIN_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return _JOIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise LaunchError(f"{JOIN_TIMEOUT_VARIABLE}={raw!r} is not a positive number of seconds",
                          hint=f"unset {JOIN_TIMEOUT_VARIABLE} (120 s) or give it seconds, e.g. 300")
    return value


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id of the Slurm job this process runs in (SLURM_JOB_ID), or None outside Slurm."""
    env = os.environ if environ is None else environ
    return env.get("SLURM_JOB_ID") or None


def shared_store_restarts(environ: Mapping[str, str] | None = None) -> int:
    """The restarts torchrun may make of a job whose ranks use the agent's rendezvous store (its default since torch
    2.5); 0 otherwise. Such a store outlives a restart: the ranks of the next round can read the addresses of the
    last one and fail to connect (pytorch/pytorch#135712); TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 avoids it."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return 0
    return _int(env, "TORCHELASTIC_MAX_RESTARTS", 0)


def elastic_restarts_left(environ: Mapping[str, str] | None = None) -> int | None:
    """The restarts torchrun's elastic agent may still make of this job (TORCHELASTIC_MAX_RESTARTS less
    TORCHELASTIC_RESTART_COUNT); None when torchrun did not start this process."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_MAX_RESTARTS" not in env:
        return None
    return max(0, _int(env, "TORCHELASTIC_MAX_RESTARTS", 0) - _int(env, "TORCHELASTIC_RESTART_COUNT", 0))


def elastic_round(environ: Mapping[str, str] | None = None) -> int:
    """Which start of this job torchrun's elastic agent made (TORCHELASTIC_RESTART_COUNT: 0 for the first, and
    outside torchrun)."""
    env = os.environ if environ is None else environ
    return _int(env, "TORCHELASTIC_RESTART_COUNT", 0)


def under_torchrun_agent(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's elastic agent started this process (it is then the process's parent)."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for ranks spawned on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
