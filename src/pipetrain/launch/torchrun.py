"""Ranks started by torchrun (or by hand with its variables): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE and MASTER_* read into a `ClusterEnv`. Reads no environment itself: `launch/env.py`
hands the variables over."""

from __future__ import annotations

from collections.abc import Mapping

from pipetrain.errors import LaunchError
from pipetrain.launch.ranks import ClusterEnv
from pipetrain.launch.variables import below, integer, port

__all__ = ["from_torchrun"]


def from_torchrun(env: Mapping[str, str]) -> ClusterEnv:
    """The rank layout torchrun exports (RANK, WORLD_SIZE, LOCAL_*, GROUP_*, MASTER_*), each refused with the fix."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise LaunchError(f"{given} is set but {missing} is not", hint="set both (torchrun does) or neither")
    rank = integer(env, "RANK")
    world_size = integer(env, "WORLD_SIZE", minimum=1)
    below("RANK", rank, "WORLD_SIZE", world_size)
    local_world_size = integer(env, "LOCAL_WORLD_SIZE", world_size, minimum=1)
    if local_world_size > world_size:
        raise LaunchError(
            f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}",
            hint="a node cannot run more ranks than the job has",
        )
    local_rank = integer(env, "LOCAL_RANK", rank if local_world_size == world_size else None)
    below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
    num_nodes = integer(env, "GROUP_WORLD_SIZE", -(-world_size // local_world_size), minimum=1)
    node_rank = integer(env, "GROUP_RANK", rank // local_world_size)
    below("GROUP_RANK", node_rank, "GROUP_WORLD_SIZE", num_nodes)
    if world_size > 1 and "MASTER_PORT" not in env:
        raise LaunchError(
            f"WORLD_SIZE={world_size} but MASTER_PORT is not set",
            hint="launch with torchrun, or export MASTER_ADDR and MASTER_PORT for every rank",
        )
    if num_nodes > 1 and "MASTER_ADDR" not in env:
        raise LaunchError(
            f"{num_nodes} nodes but MASTER_ADDR is not set", hint="export MASTER_ADDR=<host of rank 0>"
        )
    master_addr, master_port = env.get("MASTER_ADDR", "127.0.0.1"), port(env, "MASTER_PORT", 29500)
    return ClusterEnv(rank, world_size, local_rank, local_world_size, node_rank, num_nodes, master_addr, master_port,
                      "torchrun")
