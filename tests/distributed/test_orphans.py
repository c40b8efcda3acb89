"""No rank outlives its job: `pipetrain train --pp 2` (the tiny preset, a run far longer than the test) is started in
a process group of its own, one process of it is killed (the fork server, the launcher with SIGKILL, a rank), and
within seconds no process of that group is left; the message names what died. Processes are found by their
process group (the launcher's pid), never by name across the machine. Fails on main: the ranks (and the fork
server) outlived a killed fork server or launcher, and a dead fork server was reported as a rank's death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ARGS = ["train", "--preset", "tiny", "--data", "synthetic", "--pp", "2", "--chunks", "2", "--batch-size", "8", "--train-samples", "160",
        "--test-samples", "16", "--epochs", "100000", "--no-progress", "--step-timeout", "0", "--device", "cpu"]
#: Seconds every process of the job has to end after the kill (it takes about one on an idle machine).
END_S = 30.0


def _group(pgid: int) -> dict[int, tuple[str, str]]:
    """The live processes of process group `pgid`: pid -> (name, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        state, _, group = stat[stat.rindex(")") + 2:].split()[:3]
        if int(group) == pgid and state not in ("Z", "X"):
            found[int(entry.name)] = (name, cmdline)
    return found


def _victim(kind: str, job: subprocess.Popen, members: dict[int, tuple[str, str]]) -> int:
    if kind == "launcher":
        return job.pid
    if kind == "rank":
        return next(pid for pid, (name, _) in members.items() if name == "pipetrain-r1")
    return next(pid for pid, (name, cmd) in members.items()
                if "forkserver" in cmd and not name.startswith("pipetrain-r") and pid != job.pid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("kind", ["forkserver", "launcher", "rank"])
def test_no_process_of_the_job_outlives_a_kill(kind, tmp_path):
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        job = subprocess.Popen([sys.executable, "-m", "pipetrain", *ARGS], start_new_session=True, cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=err, env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while True:  # both ranks run (and have for a moment: their lifelines are watched)
            members = _group(job.pid)
            ranks = [pid for pid, (name, _) in members.items() if name.startswith("pipetrain-r")]
            if len(ranks) == 2:
                break
            assert job.poll() is None and time.monotonic() < deadline, err_path.read_text()
            time.sleep(0.2)
        time.sleep(2.0)
        victim = _victim(kind, job, _group(job.pid))
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        while _group(job.pid) and time.monotonic() - killed < END_S:
            job.poll()
            time.sleep(0.1)
        left = _group(job.pid)
        assert not left, f"{len(left)} processes of the job still run {END_S:g} s after the kill: {left}"
    finally:
        leftover = _group(job.pid)
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.wait()
    said = err_path.read_text()
    if kind == "forkserver":
        assert job.returncode == 2 and f"the fork server (pid {victim}) that started the ranks died" in said, said
        assert "exited with code 255" not in said, said
    elif kind == "rank":
        assert job.returncode == 2 and "pipetrain-rank1 exited with code -9 (SIGKILL) without a report" in said, said
    else:
        assert f"the launcher of this job (pid {victim}) is gone (killed?)" in said, said
        assert said.count("is gone") == 1, said  # one rank says it
