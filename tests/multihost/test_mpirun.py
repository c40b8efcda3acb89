"""Open MPI's mpirun across the two hosts (network namespaces, scripts/netns-cluster.sh): dp=2 x pp=2, each pipeline
inside one host and the replicas across the link, started by one `mpirun` on host 0; the losses equal a one-process
run's (the tolerance of test_jobs.py). mpirun starts its daemon on host 1 through scripts/netns-rsh.sh, an rsh
agent that runs the command in host 1's namespace (no sshd). Skipped without `mpirun` or network namespaces.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from scripts.netns_cluster import ADDRESSES, Cluster, environ, losses, wait_all
from tests.multihost.test_jobs import JOB_TIMEOUT_S, PROBLEM, STEPS, TRAIN, _assert_no_process_left, _close
from tests.distributed.test_mpi import passed_on

MPIRUN = shutil.which("mpirun")
AGENT = Path(__file__).resolve().parents[2] / "scripts" / "netns-rsh.sh"
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""),
              pytest.mark.skipif(MPIRUN is None, reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")]


def test_mpirun_across_two_hosts_equals_one_process(cluster: Cluster, reference, tmp_path):
    run_dir = tmp_path / "run"
    env = environ(NETNS_CLUSTER=cluster.name)
    argv = [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
            "--mca", "plm_rsh_agent", str(AGENT), "--host", f"{ADDRESSES[0]}:2,{ADDRESSES[1]}:2", "-np", "4",
            *passed_on(env), sys.executable, *TRAIN, "--dp", "2", "--pp", "2", "--run-dir", str(run_dir)]
    job = cluster.start(0, argv, env, "mpirun.log")
    assert wait_all([job], JOB_TIMEOUT_S) == [0], cluster.output("mpirun.log")
    output = cluster.output("mpirun.log")
    assert "dp=2 (ddp) x pp=2" in output, output
    _close(losses(run_dir), reference)
    assert len(losses(run_dir)) == STEPS
    _assert_no_process_left(cluster)
