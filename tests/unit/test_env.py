"""Cluster environment detection from torchrun and Slurm variables, with the environment patched."""

from __future__ import annotations

import socket

import pytest

from pipetrain.errors import LaunchError
from pipetrain.launch.env import (
    ClusterEnv,
    detect,
    expand_for_local_ranks,
    expand_nodelist,
    expand_tasks_per_node,
    free_port,
    slurm_port,
)

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node01",
    "MASTER_PORT": "29400",
}


def slurm_step(**overrides: str) -> dict[str, str]:
    """What srun exports to task 5 of `srun -N 2 --ntasks-per-node 4` in job 123456 (one task per GPU)."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "jz[007-008]",
        "SLURM_STEP_NODELIST": "jz[007-008]",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_nothing_set_means_local_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    assert detect({}) is None
    assert detect({"SLURM_JOB_ID": "7", "PATH": "/bin"}) is None
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID", "SLURM_STEPID"):
        monkeypatch.delenv(name, raising=False)
    assert detect() is None


def test_batch_script_outside_srun_is_not_a_step() -> None:
    # The batch step exports SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step id.
    assert detect(slurm_step(SLURM_STEP_ID="<unset>", SLURM_PROCID="0", SLURM_LOCALID="0")) is None


def test_torchrun() -> None:
    env = detect(TORCHRUN)
    assert env == ClusterEnv(
        rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="node01", master_port=29400, source="torchrun",
    )
    assert env.torch_environ()["RANK"] == "5"
    assert not env.one_task_per_node


def test_torchrun_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    env = detect()
    assert env is not None and env.source == "torchrun" and env.rank == 5


def test_torchrun_wins_over_slurm() -> None:
    env = detect({**slurm_step(), **TORCHRUN})
    assert env is not None and env.source == "torchrun" and env.master_port == 29400


def test_single_process_defaults() -> None:
    env = detect({"RANK": "0", "WORLD_SIZE": "1"})
    assert env is not None
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (0, 1, 0, 1)
    assert env.master_addr == "127.0.0.1"


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"RANK": "8"}, ["RANK=8", "WORLD_SIZE=8"]),
        ({"LOCAL_RANK": "4"}, ["LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"]),
        ({"LOCAL_WORLD_SIZE": "16"}, ["LOCAL_WORLD_SIZE=16", "WORLD_SIZE=8"]),
        ({"WORLD_SIZE": "eight"}, ["WORLD_SIZE='eight'"]),
        ({"RANK": "-1"}, ["RANK=-1"]),
        ({"WORLD_SIZE": None}, ["RANK", "WORLD_SIZE"]),
        ({"RANK": None}, ["WORLD_SIZE", "RANK"]),
        ({"MASTER_PORT": None}, ["MASTER_PORT"]),
        ({"MASTER_ADDR": None}, ["MASTER_ADDR"]),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
        ({"GROUP_RANK": "2", "GROUP_WORLD_SIZE": "2"}, ["GROUP_RANK=2"]),
    ],
)
def test_torchrun_conflicts(changes: dict[str, str | None], names: list[str]) -> None:
    environ = {**TORCHRUN, **changes}
    with pytest.raises(LaunchError) as info:
        detect({k: v for k, v in environ.items() if v is not None})
    for name in names:
        assert name in str(info.value)
    assert info.value.hint


def test_slurm_one_task_per_gpu() -> None:
    env = detect(slurm_step())
    assert env == ClusterEnv(
        rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="jz007", master_port=20000 + 123456 % 20000, source="slurm",
    )
    assert 20000 <= env.master_port < 40000


def test_slurm_uneven_tasks_per_node() -> None:
    env = detect(
        slurm_step(
            SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_NODEID="3", SLURM_STEP_NUM_TASKS="7", SLURM_NTASKS="7",
            SLURM_STEP_NUM_NODES="4", SLURM_NNODES="4", SLURM_STEP_TASKS_PER_NODE="2(x3),1",
            SLURM_STEP_NODELIST="a[1-3],b9",
        )
    )
    assert env is not None
    assert (env.rank, env.local_world_size, env.node_rank, env.master_addr) == (6, 1, 3, "a1")


def test_slurm_master_from_environment_and_job_nodelist() -> None:
    env = detect(slurm_step(MASTER_ADDR="10.0.0.1", MASTER_PORT="31000"))
    assert env is not None and (env.master_addr, env.master_port) == ("10.0.0.1", 31000)
    env = detect(slurm_step(SLURM_STEP_NODELIST="<unset>", SLURM_JOB_NODELIST="gpu-[008-010]-x"))
    assert env is not None and env.master_addr == "gpu-008-x"


def test_slurm_older_variable_names() -> None:
    env = detect(
        slurm_step(
            SLURM_STEP_ID="<unset>", SLURM_STEPID="0", SLURM_STEP_NUM_TASKS="<unset>",
            SLURM_STEP_NUM_NODES="<unset>", SLURM_STEP_TASKS_PER_NODE="<unset>", SLURM_STEP_NODELIST="<unset>",
        )
    )
    assert env is not None and (env.rank, env.world_size, env.local_world_size) == (5, 8, 4)


def test_slurm_one_task_per_node_expands_to_local_ranks() -> None:
    node = detect(
        slurm_step(
            SLURM_PROCID="2", SLURM_LOCALID="0", SLURM_NODEID="2", SLURM_STEP_NUM_TASKS="3", SLURM_NTASKS="3",
            SLURM_STEP_NUM_NODES="3", SLURM_NNODES="3", SLURM_STEP_TASKS_PER_NODE="1(x3)",
            SLURM_NTASKS_PER_NODE="1", SLURM_STEP_NODELIST="node[01-03]",
        )
    )
    assert node is not None and node.one_task_per_node
    assert (node.rank, node.world_size, node.node_rank, node.num_nodes) == (2, 3, 2, 3)
    ranks = expand_for_local_ranks(node, 4)
    assert [r.rank for r in ranks] == [8, 9, 10, 11]
    assert [r.local_rank for r in ranks] == [0, 1, 2, 3]
    assert {(r.world_size, r.local_world_size, r.node_rank, r.master_addr) for r in ranks} == {(12, 4, 2, "node01")}
    assert ranks[1].torch_environ()["LOCAL_WORLD_SIZE"] == "4"


def test_expand_refuses_several_tasks_per_node() -> None:
    env = detect(slurm_step())
    assert env is not None
    with pytest.raises(LaunchError, match="one task per node"):
        expand_for_local_ranks(env, 2)
    with pytest.raises(LaunchError, match="positive"):
        expand_for_local_ranks(env, 0)


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"SLURM_PROCID": "8"}, ["SLURM_PROCID=8", "SLURM_STEP_NUM_TASKS=8"]),
        ({"SLURM_PROCID": "x"}, ["SLURM_PROCID='x'"]),
        ({"SLURM_LOCALID": "4"}, ["SLURM_LOCALID=4", "SLURM_STEP_TASKS_PER_NODE"]),
        ({"SLURM_NODEID": "2"}, ["SLURM_NODEID=2", "SLURM_STEP_NUM_NODES=2"]),
        ({"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, ["SLURM_STEP_TASKS_PER_NODE='3(x2)'"]),
        ({"SLURM_STEP_TASKS_PER_NODE": "4x2"}, ["'4x2'"]),
        ({"SLURM_STEP_NODELIST": "jz[007-008"}, ["jz[007-008"]),
        ({"SLURM_JOB_ID": "<unset>"}, ["SLURM_JOB_ID"]),
    ],
)
def test_slurm_conflicts(changes: dict[str, str], names: list[str]) -> None:
    with pytest.raises(LaunchError) as info:
        detect(slurm_step(**changes))
    for name in names:
        assert name in str(info.value)
    assert info.value.hint


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu-[008-010]-x", ["gpu-008-x", "gpu-009-x", "gpu-010-x"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
        ("jz[099-101],login.example.org", ["jz099", "jz100", "jz101", "login.example.org"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[01", "node]1", "a,,b", "n[3-1]", "n[a-b]", "n[[1]]", "n[]", "a b"])
def test_malformed_nodelist(nodelist: str) -> None:
    with pytest.raises(LaunchError, match="node list"):
        expand_nodelist(nodelist)


def test_tasks_per_node_notation() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(LaunchError):
        expand_tasks_per_node("2(3)")


def test_ports() -> None:
    assert slurm_port(123456) == slurm_port(123456) == 23456
    assert 20000 <= slurm_port(39999) < 40000
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# mpirun: Open MPI's variables, and MPICH/Hydra's PMI ones

def open_mpi(**overrides: str) -> dict[str, str]:
    """What Open MPI 4.1's `mpirun -np 4 --map-by ppr:2:node` exports to rank 3 (two nodes; mpirun on 198.51.100.7)."""
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",  # Open MPI's "node rank" is the rank among the node's processes
        "OMPI_MCA_ess_base_jobid": "1941504001",
        "OMPI_MCA_orte_hnp_uri": "1941504000.0;tcp://198.51.100.7:37605;tcp6://[fd00::2]:58367",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_open_mpi_across_two_nodes_meets_at_mpiruns_host() -> None:
    env = detect(open_mpi())
    assert env == ClusterEnv(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, num_nodes=2,
                             master_addr="198.51.100.7", master_port=slurm_port(1941504001), source="mpi")


def test_open_mpi_on_one_node_meets_on_loopback_and_master_variables_win() -> None:
    one = open_mpi(OMPI_COMM_WORLD_LOCAL_RANK="3", OMPI_COMM_WORLD_LOCAL_SIZE="4")
    env = detect(one)
    assert env is not None and (env.num_nodes, env.node_rank, env.master_addr) == (1, 0, "127.0.0.1")
    env = detect({**open_mpi(), "MASTER_ADDR": "node07", "MASTER_PORT": "29600"})
    assert env is not None and (env.master_addr, env.master_port) == ("node07", 29600)


def test_open_mpi_wins_over_the_slurm_step_of_its_daemons() -> None:
    # mpirun in a Slurm allocation starts one daemon per node with srun: SLURM_PROCID is the node, not the rank
    env = detect({**slurm_step(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2"), **open_mpi()})
    assert env is not None and (env.source, env.rank, env.world_size) == ("mpi", 3, 4)


def test_rank_0_away_from_mpiruns_host_is_told_to_set_master_addr() -> None:
    with pytest.raises(LaunchError, match=r"rank 0 does not run on mpirun's host 198\.51\.100\.7") as info:
        detect(open_mpi(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_LOCAL_RANK="0"))
    assert "MASTER_ADDR" in info.value.hint


def test_pmi_launchers() -> None:
    hydra = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
    env = detect(hydra)
    assert env == ClusterEnv(rank=2, world_size=4, local_rank=2, local_world_size=4, node_rank=0, num_nodes=1,
                             master_addr="127.0.0.1", master_port=29500, source="mpi")
    with pytest.raises(LaunchError, match="no MASTER_ADDR") as info:
        detect({**hydra, "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "0"})
    assert "MASTER_ADDR" in info.value.hint
    # srun's own PMI (--mpi=pmi2) gives the same rank as Slurm: read as a Slurm step
    assert detect({**slurm_step(), "PMI_RANK": "5", "PMI_SIZE": "8"}).source == "slurm"


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"OMPI_COMM_WORLD_RANK": "4"}, ["OMPI_COMM_WORLD_RANK=4", "OMPI_COMM_WORLD_SIZE=4"]),
        ({"OMPI_COMM_WORLD_SIZE": "<unset>"}, ["OMPI_COMM_WORLD_SIZE"]),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, ["OMPI_COMM_WORLD_LOCAL_SIZE=8", "OMPI_COMM_WORLD_SIZE=4"]),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ["OMPI_COMM_WORLD_LOCAL_RANK=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2"]),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
    ],
)
def test_open_mpi_conflicts(changes: dict[str, str], names: list[str]) -> None:
    with pytest.raises(LaunchError) as info:
        detect(open_mpi(**changes))
    for name in names:
        assert name in str(info.value)
    assert info.value.hint
