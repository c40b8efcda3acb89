"""Slurm time limits on the real local cluster: SIGUSR1 (what `--signal=USR1@N` sends before the limit) makes
every rank stop at one step and save; the job requeues itself, resumes, completes, and its final losses equal
an uninterrupted local run's. The uninterrupted run starts once the signal is sent: it runs while Slurm holds the
requeued job (about 16 s), time the test spent waiting anyway. The job saves every 25 of its 100 steps (every 4, its
saves took most of the resumed run's time): the first checkpoint, at step 25, triggers the signal with 75 steps
still to go (the signal lands within a few of them), and the stop's own save is the one resumed from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipetrain.checkpoint import complete_checkpoints
from tests.slurm.test_slurm_job import _cluster_problem, submit_script, wait_until_completed

pytestmark = pytest.mark.slurm

WAIT_SECONDS = 300
TRAIN = ["--preset", "tiny", "--data", "synthetic", "--train-samples", "1600", "--test-samples", "32",
         "--batch-size", "16", "--epochs", "1", "--no-progress", "--save-every", "25"]


def _losses(path: Path) -> list[tuple[float, float]]:
    return [(r["train_loss"], r["test_loss"]) for r in json.loads(path.read_text())]


@pytest.fixture
def job_dir():
    """A folder of its own (pytest's tmp folders of other sessions on the machine may be cleaned meanwhile)."""
    folder = Path(tempfile.mkdtemp(prefix="pipetrain-requeue-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(WAIT_SECONDS + 300)
def test_warning_signal_saves_requeues_and_the_job_resumes_to_the_same_losses(job_dir: Path) -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)
    tmp_path = job_dir
    render = subprocess.run(
        [sys.executable, "-m", "pipetrain", "sbatch", "--ntasks-per-node", "2", "--cpus-per-task", "1",
         "--time", "00:15:00", "--pp", "2", "--job-name", "pipetrain-requeue", "--log", "job-%j.out",
         "--output", "script.sh", "--", *TRAIN, "--save-dir", str(tmp_path / "ckpt"),
         "--metrics", str(tmp_path / "metrics.json")],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert render.returncode == 0, render.stderr
    job_id = submit_script(tmp_path)
    signalled = False
    reference: list[subprocess.Popen] = []

    def each(fields: dict[str, str]) -> None:
        # Slurm then holds the requeued job until the old credential is revoked (scripts/slurm-up.sh sets
        # cred_expire=15, so about 16 s): nothing here hurries it, which would race that revocation.
        nonlocal signalled
        if not signalled and complete_checkpoints(tmp_path / "ckpt"):  # training under way: time is up
            subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)
            signalled = True
            with (tmp_path / "reference.log").open("w") as log:
                reference.append(subprocess.Popen(
                    [sys.executable, "-m", "pipetrain", "train", *TRAIN, "--pp", "2", "--save-dir",
                     str(tmp_path / "reference"), "--metrics", str(tmp_path / "reference.json")],
                    stdout=log, stderr=subprocess.STDOUT, text=True))

    try:
        _, output = wait_until_completed(job_id, tmp_path / f"job-{job_id}.out", seconds=WAIT_SECONDS, poll_s=0.5,
                                         each=each, done=lambda fields: fields.get("Restarts", "0") != "0")
        assert "stopped by SIGUSR1 after step" in output and f"requeued Slurm job {job_id}" in output, output
        assert "resumed from" in output, output
        assert reference, "the job was never signalled"
        assert reference[0].wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()
    finally:
        for job in reference:
            if job.poll() is None:
                job.kill()
                job.wait()
    assert _losses(tmp_path / "metrics.json") == _losses(tmp_path / "reference.json")
