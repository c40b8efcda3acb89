"""Ranks started by srun: a Slurm step's variables (SLURM_PROCID, SLURM_STEP_*, SLURM_*NODELIST...) read into a
`ClusterEnv`. Reads no environment itself: `launch/env.py` hands the variables over."""

from __future__ import annotations

from collections.abc import Mapping

from pipetrain.errors import LaunchError
from pipetrain.launch.mpi import PMI_RANK
from pipetrain.launch.nodelist import expand_nodelist, expand_tasks_per_node
from pipetrain.launch.ranks import ClusterEnv
from pipetrain.launch.variables import agreed_port, below, integer, port

__all__ = ["from_slurm", "slurm_port", "slurm_task"]


def slurm_task(env: Mapping[str, str]) -> bool:
    """True when srun started this process as a task of its own (its PMI rank, if any, is its Slurm rank); False
    for a process that a PMI launcher started under a daemon srun placed (Hydra in an allocation)."""
    return ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and env.get("SLURM_PROCID") == env.get(PMI_RANK)


def slurm_port(job_id: int) -> int:
    """The rendezvous port every task of Slurm job `job_id` agrees on without talking: in [20000, 40000)."""
    return agreed_port(job_id)


def from_slurm(env: Mapping[str, str]) -> ClusterEnv:
    """The rank layout of a task of a Slurm step (SLURM_PROCID, the step's task and node counts, SLURM_LOCALID); rank
    0's host is MASTER_ADDR or the first of the step's nodes, the port MASTER_PORT or `slurm_port` of the job."""
    rank = integer(env, "SLURM_PROCID")
    tasks_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world_size = integer(env, tasks_name, minimum=1)
    below("SLURM_PROCID", rank, tasks_name, world_size)
    nodes_name = "SLURM_STEP_NUM_NODES" if "SLURM_STEP_NUM_NODES" in env else "SLURM_NNODES"
    num_nodes = integer(env, nodes_name, 1, minimum=1)
    node_rank = integer(env, "SLURM_NODEID", 0)
    below("SLURM_NODEID", node_rank, nodes_name, num_nodes)

    per_node_name = next(
        (n for n in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE") if n in env), None
    )
    if per_node_name is None:
        local_world_size = world_size if num_nodes == 1 else 0
        if not local_world_size:
            raise LaunchError(
                f"{num_nodes} nodes but no SLURM_STEP_TASKS_PER_NODE", hint="launch the ranks with srun"
            )
    else:
        counts = expand_tasks_per_node(env[per_node_name])
        if len(counts) == 1:
            counts *= num_nodes
        if len(counts) != num_nodes or sum(counts) != world_size:
            raise LaunchError(
                f"{per_node_name}={env[per_node_name]!r} does not describe {world_size} tasks "
                f"({tasks_name}) on {num_nodes} nodes ({nodes_name})",
                hint="unset stale SLURM_* variables; launch with srun inside the allocation",
            )
        local_world_size = counts[node_rank]
    local_rank = integer(env, "SLURM_LOCALID", 0)
    if local_rank >= local_world_size:
        raise LaunchError(
            f"SLURM_LOCALID={local_rank} but node {node_rank} runs {local_world_size} task(s) "
            f"({per_node_name or tasks_name})",
            hint="SLURM_LOCALID counts the tasks of one node from 0; unset stale SLURM_* variables",
        )

    master_addr = env.get("MASTER_ADDR")
    if master_addr is None:
        list_name = next(
            (n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if n in env), None
        )
        if list_name is None:
            raise LaunchError(
                "cannot find rank 0's host: no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST",
                hint="export MASTER_ADDR=<host of rank 0>",
            )
        master_addr = expand_nodelist(env[list_name])[0]
    if "MASTER_PORT" in env:
        master_port = port(env, "MASTER_PORT", 0)
    else:
        master_port = slurm_port(integer(env, "SLURM_JOB_ID"))
    return ClusterEnv(rank, world_size, local_rank, local_world_size, node_rank, num_nodes, master_addr, master_port,
                      "slurm")
