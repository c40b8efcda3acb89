"""Ranks started by Open MPI's `mpirun` (the Horovod way): `mpirun -np 4 pipetrain train --dp 2 --pp 2` trains the
losses of the same job in one process (within 5e-5, the multi-host tier's tolerance), and a rank killed under mpirun ends the job with one message.

Needs Debian's Open MPI (`apt-get install openmpi-bin`; `make test` installs it through scripts/mpi-up.sh): skipped
when `mpirun` is absent. Run as root here, hence `--allow-run-as-root`; `--oversubscribe` lets 4 ranks share the
cores of a small machine. Every job runs in subprocesses with a bounded wait; the processes are killed by pid.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.cli.main import main
from scripts.netns_cluster import losses
from tests.distributed.test_launch import JOB, JOB_TIMEOUT_S, _kill_trees, _tree, environ, run_together

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="needs Open MPI's mpirun (apt-get install openmpi-bin)")

STEP = re.compile(r"^step (\d+)/\d+ \| loss (\d+\.\d+) \| acc ([\d.]+)", re.MULTILINE)
TRAIN = [sys.executable, "-m", "pipetrain", "train"]


def passed_on(env: dict[str, str]) -> list[str]:
    """Open MPI's `-x NAME` for each variable the ranks need that `env` sets (a remote rank gets only these)."""
    names = ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
    return [arg for name in names if name in env for arg in ("-x", name)]


def mpirun(np: int, *argv: str) -> list[str]:
    """`mpirun -np N` with environ()'s variables passed on to every rank."""
    return [str(MPIRUN), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np),
            *passed_on(environ()), *argv]


def _one_process(*args: str) -> int:
    """`pipetrain train ARGS --dp 1 --pp 1` in this process, with environ()'s variables (one thread); its exit code."""
    with pytest.MonkeyPatch.context() as patch:
        for name in set(os.environ) - set(environ()):
            patch.delenv(name)
        for name, value in environ(PIPETRAIN_DEVICE="cpu").items():
            patch.setenv(name, value)
        return main(["train", *args, "--dp", "1", "--pp", "1"])


def test_mpirun_trains_like_one_process(tmp_path):
    job = [*JOB, "--log-every", "1"]
    [(code, mpi)] = run_together([(mpirun(4, *TRAIN, *job, "--run-dir", str(tmp_path / "mpirun")), environ())],
                                 tmp_path, JOB_TIMEOUT_S)
    assert code == 0, mpi
    assert "dp=2 (ddp) x pp=2" in mpi
    assert len(STEP.findall(mpi)) == 4, mpi  # printed once, by rank 0
    assert _one_process(*job, "--run-dir", str(tmp_path / "one")) == 0
    got, want = losses(tmp_path / "mpirun"), losses(tmp_path / "one")
    assert sorted(got) == sorted(want) == [1, 2, 3, 4], (got, want)
    worst = max(abs(got[step] - want[step]) for step in want)
    assert worst <= 5e-5, (got, want)


def test_a_world_that_does_not_fit_the_layout_is_said_once(tmp_path):
    [(code, output)] = run_together([(mpirun(2, *TRAIN, *JOB), environ())], tmp_path, timeout_s=120)
    assert code != 0, output
    assert output.count("pipetrain: error:") == 1, output
    assert "dp=2 x pp=2 = 4 ranks, but the job has 2 (hint: launch 4 ranks" in output, output
    assert "Traceback" not in output, output


def _rank_process(root: int, rank: int) -> int | None:
    """The pid of the process of MPI rank `rank` among `root`'s descendants, None while it has not started."""
    for pid in _tree(root):
        try:
            names = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in names:
            return pid
    return None


def test_a_rank_killed_under_mpirun_ends_the_job_with_one_message(tmp_path):
    long_job = [*JOB, "--train-samples", "6400", "--log-every", "1"]  # 400 steps: far longer than the test waits
    log = tmp_path / "mpirun.log"
    with log.open("w") as out:
        process = subprocess.Popen(mpirun(4, *TRAIN, *long_job, "--run-dir", str(tmp_path / "run")), env=environ(),
                                   stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while "step 2/" not in log.read_text():  # training, every rank past its first step
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        victim = _rank_process(process.pid, 1)
        assert victim is not None
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = process.wait(timeout=60)
        ended_s = time.monotonic() - killed
    finally:
        _kill_trees([process])
    output = log.read_text()
    assert code != 0, output
    assert ended_s < 30, output  # mpirun ends the other ranks at once (pipetrain's own wait would be longer)
    # the one message: mpirun's, naming the rank and its signal; the ranks it stopped say nothing
    assert output.count("mpirun noticed that process rank 1 with PID") == 1, output
    assert "exited on signal 9 (Killed)" in output, output
    assert "Traceback" not in output and "pipetrain: error" not in output, output
    assert not _left_over(process.pid), output  # mpirun ended every rank (zombies waiting for init aside)


def _left_over(root: int) -> list[int]:
    """The processes of `root`'s session still running (not zombies), after a short grace."""
    deadline = time.monotonic() + 10
    while True:
        left = []
        for pid in _tree(root):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if pid != root and state != "Z":
                left.append(pid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)
