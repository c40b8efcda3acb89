"""`pipetrain train` jobs started side by side from a test: start several, then finish each (killed on timeout)."""

from __future__ import annotations

import os
import subprocess
import sys


def start_train(*args: str, merge_stderr: bool = False) -> subprocess.Popen:
    """Start `python -m pipetrain train ARGS` with one thread per rank; stderr into stdout if `merge_stderr`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pipetrain", "train", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)


def finish(job: subprocess.Popen, timeout: float) -> str:
    """The job's stdout once it exited 0 (the assertion shows its output otherwise); killed if still running."""
    try:
        out, err = job.communicate(timeout=timeout)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, out + (err or "")
    return out
