"""A batch script rendered by `pipetrain sbatch --launcher mpirun` runs on the local Slurm cluster: Open MPI's mpirun
reads the allocation, starts the ranks, and the job completes with a loss. Skipped without the cluster or mpirun.

Slurm runs the job as root here, which mpirun refuses unless told (OMPI_ALLOW_RUN_AS_ROOT*, exported by `--setup`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.test_slurm_job import LOSS, WAIT_SECONDS, _cluster_problem, submit_script, wait_until_completed

pytestmark = pytest.mark.slurm


def test_an_mpirun_script_completes_and_reports_a_loss(tmp_path: Path) -> None:
    problem = _cluster_problem() or (None if shutil.which("mpirun") else "needs Open MPI's mpirun (scripts/mpi-up.sh)")
    if problem:
        pytest.skip(problem)
    render = subprocess.run(
        [sys.executable, "-m", "pipetrain", "sbatch", "--launcher", "mpirun", "--nodes", "1", "--ntasks-per-node",
         "2", "--cpus-per-task", "1", "--time", "00:10:00", "--dp", "1", "--pp", "2", "--job-name", "pipetrain-mpi",
         "--log", "job-%j.out", "--output", "script.sh",
         "--setup", "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
         "--", "--preset", "tiny", "--data", "synthetic", "--epochs", "1", "--max-steps", "5", "--batch-size", "16",
         "--chunks", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )
    assert render.returncode == 0, render.stderr
    script = (tmp_path / "script.sh").read_text()
    assert "\nmpirun -np $(( SLURM_JOB_NUM_NODES * 2 ))" in script and "\nsrun " not in script

    job_id = submit_script(tmp_path)
    fields, output = wait_until_completed(job_id, tmp_path / f"job-{job_id}.out", seconds=WAIT_SECONDS, poll_s=2)
    assert fields.get("ExitCode") == "0:0", f"job {job_id} exit code {fields.get('ExitCode')}\n{output}"
    assert "dp=1 (ddp) x pp=2" in output, output  # one job of two ranks, said once by rank 0
    assert LOSS.search(output), f"no 'loss <number>' line in job-{job_id}.out:\n{output}"
