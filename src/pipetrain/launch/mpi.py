"""Ranks started by `mpirun`/`mpiexec`: Open MPI's and MPICH (Hydra)'s variables read into a `ClusterEnv`.

Open MPI exports `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK` and `_LOCAL_SIZE` to every process it starts, and
the address of `mpirun` itself (`OMPI_MCA_orte_hnp_uri`, "jobid.vpid;tcp://ADDRESS:PORT;..."), and a job id
(`OMPI_MCA_ess_base_jobid`). MPICH's Hydra exports `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID` and `MPI_LOCALNRANKS`.
Neither exports the host list, and torch's process group needs a TCP rendezvous, not MPI: the address is
`MASTER_ADDR` when set, else 127.0.0.1 for a job on one host, else (Open MPI) the host `mpirun` runs on, where its
default by-slot mapping places rank 0 (rank 0 checks that it runs there and says so when not). The port is
`MASTER_PORT`, else one every rank derives from Open MPI's job id, else 29500 (torchrun's default).

Ranks are numbered by slot (`mpirun`'s default mapping): a node's ranks are consecutive, so the node of a rank is
its rank divided by the ranks per node. Reads no environment itself: `launch/env.py` hands the variables over.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pipetrain.errors import LaunchError
from pipetrain.launch import netif
from pipetrain.launch.ranks import ClusterEnv
from pipetrain.launch.variables import agreed_port, below, integer, port

__all__ = ["OPEN_MPI_RANK", "PMI_RANK", "from_open_mpi", "from_pmi", "launcher_host"]

#: The variable whose presence says Open MPI started this process.
OPEN_MPI_RANK = "OMPI_COMM_WORLD_RANK"
#: The variable whose presence says a PMI launcher (MPICH's Hydra, Intel MPI) started this process.
PMI_RANK = "PMI_RANK"
_DEFAULT_PORT = 29500
_TCP = re.compile(r"tcp://([0-9.]+):\d+")


def from_open_mpi(env: Mapping[str, str]) -> ClusterEnv:
    """This process's place in a job started by Open MPI's `mpirun`."""
    return _cluster(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE", launcher=launcher_host(env.get("OMPI_MCA_orte_hnp_uri", "")),
                    job_id=env.get("OMPI_MCA_ess_base_jobid"))


def from_pmi(env: Mapping[str, str]) -> ClusterEnv:
    """This process's place in a job started by a PMI launcher (MPICH's Hydra `mpiexec`, Intel MPI)."""
    return _cluster(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", launcher=None, job_id=None)


def launcher_host(uri: str) -> str | None:
    """The first IPv4 address in Open MPI's contact URI of `mpirun` ("1941504000.0;tcp://192.0.2.2:37605;..."),
    None when there is none."""
    found = _TCP.search(uri)
    return found.group(1) if found else None


def _cluster(env: Mapping[str, str], rank_name: str, size_name: str, local_name: str, local_size_name: str, *,
             launcher: str | None, job_id: str | None) -> ClusterEnv:
    rank = integer(env, rank_name)
    world_size = integer(env, size_name, minimum=1)
    below(rank_name, rank, size_name, world_size)
    local_world_size = integer(env, local_size_name, world_size, minimum=1)
    if local_world_size > world_size:
        raise LaunchError(f"{local_size_name}={local_world_size} exceeds {size_name}={world_size}",
                          hint="a node cannot run more ranks than the job has; unset stale variables")
    local_rank = integer(env, local_name, rank if local_world_size == world_size else None)
    below(local_name, local_rank, local_size_name, local_world_size)
    num_nodes = -(-world_size // local_world_size)
    node_rank = rank // local_world_size
    master_addr = _master_addr(env, rank, num_nodes, launcher)
    if "MASTER_PORT" in env:
        master_port = port(env, "MASTER_PORT", 0)
    elif job_id is not None:
        master_port = agreed_port(integer(env, "OMPI_MCA_ess_base_jobid"))
    else:
        master_port = _DEFAULT_PORT
    return ClusterEnv(rank, world_size, local_rank, local_world_size, node_rank, num_nodes, master_addr, master_port,
                      "mpi")


def _master_addr(env: Mapping[str, str], rank: int, num_nodes: int, launcher: str | None) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if num_nodes == 1:
        return "127.0.0.1"
    if launcher is None:
        raise LaunchError(f"an MPI job on {num_nodes} nodes, but no MASTER_ADDR and no address of mpirun's host",
                          hint="export MASTER_ADDR=<host of rank 0> to every rank (mpiexec -genv MASTER_ADDR ...)")
    if rank == 0 and not netif.is_loopback(launcher) and netif.interface_of_address(launcher) is None:
        raise LaunchError(f"rank 0 does not run on mpirun's host {launcher}, where the other ranks look for it",
                          hint="export MASTER_ADDR=<host of rank 0> (mpirun -x MASTER_ADDR=...), or start "
                               "mpirun on the first host of the job")
    return launcher
