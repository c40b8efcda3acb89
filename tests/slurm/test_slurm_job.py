"""A real Slurm job on the local cluster: render with `pipetrain sbatch`, submit, wait, and read the loss."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

WAIT_SECONDS = 240
USABLE_STATES = {"idle", "mix", "mixed", "alloc", "allocated", "comp", "completing"}
RUNNING_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
LOSS = re.compile(r"\bloss\b[\s:=]+[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _cluster_problem() -> str | None:
    """Why this machine cannot run the Slurm tier, or None when it can."""
    if any(shutil.which(tool) is None for tool in ("sinfo", "sbatch", "scontrol", "scancel")):
        return "sinfo/sbatch/scontrol not on PATH: start a local cluster with `bash scripts/slurm-up.sh`"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15, check=False)
        if "UP" not in ping.stdout:
            return "slurmctld does not answer `scontrol ping`: run `bash scripts/slurm-up.sh`"
        states = subprocess.run(
            ["sinfo", "--noheader", "--format=%t"], capture_output=True, text=True, timeout=15, check=False
        )
    except subprocess.TimeoutExpired:
        return "Slurm did not answer in 15 s: is slurmctld running? (`bash scripts/slurm-up.sh`)"
    usable = {s.strip().rstrip("*~#") for s in states.stdout.split()} & USABLE_STATES
    if states.returncode or not usable:
        answer = states.stdout.strip() or states.stderr.strip()
        return f"no usable Slurm node (sinfo: {answer!r}): run `bash scripts/slurm-up.sh`"
    if importlib.util.find_spec("pipetrain.cli.train") is None:
        return "the `pipetrain train` verb is not available yet (pipetrain/cli/train.py missing)"
    return None


def _job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, ...); empty once the job is forgotten."""
    shown = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job_id], capture_output=True, text=True, timeout=15, check=False
    )
    return dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)


def submit_script(folder: Path, script: str = "script.sh") -> str:
    """Submit `folder/script` with sbatch (run in `folder`); returns the job id."""
    submit = subprocess.run(["sbatch", "--parsable", f"--chdir={folder}", script], cwd=folder,
                            capture_output=True, text=True, timeout=30, check=False)
    assert submit.returncode == 0, f"sbatch refused the script: {submit.stderr}\n{(folder / script).read_text()}"
    return submit.stdout.strip().split(";")[0]


def wait_until_completed(
    job_id: str, log: Path, *, seconds: float, poll_s: float,
    each: Callable[[dict[str, str]], None] = lambda fields: None,
    done: Callable[[dict[str, str]], bool] = lambda fields: True,
) -> tuple[dict[str, str], str]:
    """Poll the job (calling `each` with its fields) until it has left the running states and `done` holds;
    cancel it if `seconds` run out. Asserts it ended COMPLETED; returns its last fields and its output."""
    fields: dict[str, str] = {}
    finished = False
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            fields = _job_fields(job_id)
            each(fields)
            if fields and fields.get("JobState") not in RUNNING_STATES and done(fields):
                finished = True
                break
            time.sleep(poll_s)
    finally:
        if not finished:
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    output = log.read_text() if log.exists() else "<no output file>"
    assert finished, f"job {job_id} still {fields.get('JobState')} after {seconds} s; cancelled\n{output}"
    assert fields.get("JobState") == "COMPLETED", f"job {job_id} ended {fields.get('JobState')}\n{output}"
    return fields, output


def test_pipeline_job_completes_and_reports_a_loss(tmp_path: Path) -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)

    render = subprocess.run(
        [sys.executable, "-m", "pipetrain", "sbatch", "--nodes", "1", "--ntasks-per-node", "2",
         "--cpus-per-task", "1", "--time", "00:10:00", "--dp", "1", "--pp", "2", "--job-name", "pipetrain-test",
         "--log", "job-%j.out", "--output", "script.sh",
         "--", "--preset", "tiny", "--data", "synthetic", "--epochs", "1", "--max-steps", "5", "--batch-size", "16",
         "--chunks", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )
    assert render.returncode == 0, render.stderr
    script = (tmp_path / "script.sh").read_text()
    assert "--pp 2" in script and "#SBATCH --gres" not in script

    job_id = submit_script(tmp_path)
    fields, output = wait_until_completed(job_id, tmp_path / f"job-{job_id}.out", seconds=WAIT_SECONDS, poll_s=2)
    assert fields.get("ExitCode") == "0:0", f"job {job_id} exit code {fields.get('ExitCode')}\n{output}"
    assert LOSS.search(output), f"no 'loss <number>' line in job-{job_id}.out:\n{output}"
