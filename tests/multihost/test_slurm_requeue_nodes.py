"""A job that heals itself through Slurm's requeue, on the two-node Slurm cluster in network namespaces
(scripts/slurm-netns.sh): `pipetrain sbatch --nodes 1-2` (one task per node spawning 2 ranks, `--pp 2`: dp2 x pp2 on
both nodes), host 1 killed mid-run with its slurmd and its ranks. Slurm sets node nsb DOWN (SlurmdTimeout), requeues
the job (`--requeue`), holds it (cred_expire + 1 s) and starts it again on nsa alone; the requeued run
(`--resume auto --on-resize auto`) lays itself out as pp2, says so in one line, resumes from the newest complete
checkpoint and trains to the end. Measured and printed: kill -> first new step, and the steps lost (at most
--save-every). The test cluster's timers are short (scripts/slurm-netns.sh; docs/multi-node.md gives Slurm's
defaults); the waits are on log lines and job states, bounded loosely (a hang fails, not slowness).

Parity: every step's loss, before the kill and after the re-layout, equals the run in one process within 5e-5 (the
elastic test's reference: checkpoints are layout-free, the data position exact)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.netns_cluster import Cluster, environ, wait_for
from tests.multihost.test_elastic import ATOL, EVERY, FIXTURES, JOB, STEPS, _records, _restart
from tests.multihost.test_slurm_two_nodes import PROBLEM, SCRIPT

pytestmark = [pytest.mark.multihost, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")]

RECOVERY_BOUND_S = 150.0
TRAIN = [*JOB, "--dp-mode", "ddp", "--checkpoint", "never", "--partition", "uniform", "--profile",
         str(FIXTURES / "tiny-profile.json"), "--calibration", str(FIXTURES / "cpu-calibration.json"), "--save-every",
         str(EVERY), "--step-timeout", "60"]


def _slurm(cluster: Cluster, conf: Path, *argv: str) -> str:
    done = subprocess.run(["nsenter", f"--net=/var/run/netns/{cluster.host(0)}", *argv], capture_output=True,
                          text=True, timeout=30, check=False, env=environ(SLURM_CONF=str(conf)))
    return done.stdout


@pytest.fixture
def job_dir() -> Iterator[Path]:
    """A folder of its own for the Slurm state, the job's log and checkpoints (pytest's tmp folders of other sessions
    on the machine may be cleaned meanwhile), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="pipetrain-heal-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_lost_node_requeues_the_job_on_the_node_left_which_relays_itself_out(cluster: Cluster, reference,
                                                                                job_dir: Path):
    tmp_path = job_dir
    slurm_dir, run_dir = tmp_path / "slurm", tmp_path / "run"
    up = subprocess.run(["bash", str(SCRIPT), "up", cluster.name, str(slurm_dir)], capture_output=True, text=True,
                        timeout=90, check=False)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        conf = slurm_dir / "slurm.conf"
        render = subprocess.run(
            [sys.executable, "-m", "pipetrain", "sbatch", "--nodes", "1-2", "--ntasks-per-node", "2",
             "--cpus-per-task", "1", "--time", "00:10:00", "--pp", "2", "--job-name", "pipetrain-heal", "--log",
             "job-%j.out", "--output", "script.sh", "--", *TRAIN, "--run-dir", str(run_dir), "--save-dir",
             str(tmp_path / "saves")],
            cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
        assert render.returncode == 0, render.stderr
        job = _slurm(cluster, conf, "sbatch", "--parsable", f"--chdir={tmp_path}", str(tmp_path / "script.sh"))
        job = job.strip().split(";")[0]
        assert job, "sbatch gave no job id"
        log = tmp_path / f"job-{job}.out"

        def state() -> str:
            return (re.search(r"JobState=(\w+)", _slurm(cluster, conf, "scontrol", "show", "job", job)) or [0, ""])[1]

        def show() -> str:
            return (f"{_slurm(cluster, conf, 'scontrol', 'show', 'job', job)}\n--- job log\n"
                    f"{log.read_text()[-6000:] if log.exists() else '<none>'}\n--- slurmctld\n"
                    f"{(slurm_dir / 'log' / 'slurmctld.log').read_text()[-3000:]}")

        assert wait_for(lambda: len(_records(run_dir)) >= 10 or state() not in ("PENDING", "RUNNING", ""),
                        240.0), show()
        assert "--layout auto chose --pp 2 --dp 2" in log.read_text(), show()  # both nodes: 4 ranks
        cluster.kill(1)  # nsb's slurmd, its slurmstepd and its two ranks
        killed_at, at_kill = time.monotonic(), len(_records(run_dir))
        resumed = re.compile(r"pipetrain: resumed from \S+/step-(\d+) ")
        assert wait_for(lambda: log.exists() and resumed.search(log.read_text()), RECOVERY_BOUND_S, 0.1), show()
        resumed_s = time.monotonic() - killed_at
        assert wait_for(lambda: len(_records(run_dir)) > at_kill, 60.0, 0.05), show()
        recovery_s = time.monotonic() - killed_at
        records = _records(run_dir)
        start = _restart(records, at_kill)
        first, done_before = records[start], records[start - 1]["step"]
        saved = int(resumed.search(log.read_text()).group(1))
        print(f"node nsb lost after step {done_before}: the requeued job resumed step {saved} on nsa "
              f"{resumed_s:.1f} s after the kill and trained its first new step (step {first['step']}) "
              f"{recovery_s:.1f} s after it; steps lost {done_before - saved} (--save-every {EVERY})")
        assert first["step"] == saved + 1 and saved % EVERY == 0 and 0 <= done_before - saved <= EVERY, \
            (first, saved, done_before)
        assert wait_for(lambda: state() not in ("PENDING", "RUNNING", "COMPLETING", ""), 240.0), show()
        shown, output = _slurm(cluster, conf, "scontrol", "show", "job", job), log.read_text()
        assert "JobState=COMPLETED" in shown and "Restarts=1" in shown and "NodeList=nsa\n" in shown, show()
        assert output.count("pipetrain: --on-resize auto: 4 → 2 ranks: dp2 × pp2 → pp2") == 1, show()
        assert "--layout auto chose --pp 2 --dp 1" in output, show()
        got = {r["step"]: r["loss"] for r in _records(run_dir)}  # a repeated step: its last record
        worst = max(abs(got[step] - reference[step]) for step in got)
        assert sorted(got) == list(range(1, STEPS + 1)) and worst <= ATOL, (worst, got, reference)
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", cluster.name, str(slurm_dir)], capture_output=True, timeout=60,
                       check=False)
