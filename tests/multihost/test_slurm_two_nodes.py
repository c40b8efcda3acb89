"""A real two-node Slurm job across the two network-namespace hosts: one slurmd per namespace (scripts/slurm-netns.sh),
`pipetrain sbatch --nodes 2` rendering pp=2 with one rank per node, submitted and run to completion (about 20 s).
Skips with one line saying why where namespaces, Slurm 22.05 or munged are missing (scripts/slurm-up.sh installs and
starts them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.netns_cluster import Cluster, netns_problem

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm-netns.sh"


def _problem() -> str | None:
    if any(shutil.which(tool) is None for tool in ("slurmctld", "slurmd", "sbatch", "nsenter", "unshare")):
        return "needs slurmctld, slurmd, sbatch (scripts/slurm-up.sh installs them), nsenter and unshare"
    if not Path("/run/munge/munge.socket.2").exists():
        return "munged is not running: start it with `bash scripts/slurm-up.sh`"
    return netns_problem()


PROBLEM = _problem()
pytestmark = [pytest.mark.multihost, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]


def _slurm(cluster: Cluster, conf: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", f"--net=/var/run/netns/{cluster.host(0)}", *argv], capture_output=True,
                          text=True, timeout=30, check=False, env={**os.environ, "SLURM_CONF": str(conf)})


def test_pipetrain_sbatch_runs_a_two_node_job_on_one_slurmd_per_namespace(cluster: Cluster, tmp_path: Path):
    slurm_dir = tmp_path / "slurm"
    up = subprocess.run(["bash", str(SCRIPT), "up", cluster.name, str(slurm_dir)], capture_output=True, text=True,
                        timeout=90, check=False)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        conf = slurm_dir / "slurm.conf"
        render = subprocess.run(
            [sys.executable, "-m", "pipetrain", "sbatch", "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task",
             "1", "--time", "00:05:00", "--dp", "1", "--pp", "2", "--job-name", "pipetrain-ns", "--log", "job-%j.out",
             "--output", "script.sh", "--", "--preset", "tiny", "--data", "synthetic", "--epochs", "1", "--max-steps",
             "3", "--batch-size", "16", "--chunks", "2", "--test-samples", "32"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
        assert render.returncode == 0, render.stderr
        submit = _slurm(cluster, conf, "sbatch", "--parsable", f"--chdir={tmp_path}", str(tmp_path / "script.sh"))
        assert submit.returncode == 0, submit.stderr
        job = submit.stdout.strip().split(";")[0]
        deadline, state = time.monotonic() + 240, ""
        while time.monotonic() < deadline:
            shown = _slurm(cluster, conf, "scontrol", "show", "job", job).stdout
            state = (re.search(r"JobState=(\w+)", shown) or [None, ""])[1]
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""):
                break
            time.sleep(1)
        log = tmp_path / f"job-{job}.out"
        output = log.read_text() if log.exists() else "<no output>"
        assert state == "COMPLETED", f"job {job}: {state}\n{shown}\n{output[-3000:]}"
        assert "NodeList=nsa,nsb" in shown, shown  # one rank on each namespace's node
        assert re.search(r"step 3/3 \| loss \d", output), output[-3000:]
        assert "dp=1 (ddp) x pp=2" in output
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", cluster.name, str(slurm_dir)], capture_output=True, timeout=60,
                       check=False)
