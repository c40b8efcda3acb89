"""What the benchmarks that time whole `pipetrain` commands share: the command run as a child process (one
thread per rank), and the load average they print beside their figures (the CPU is shared)."""

from __future__ import annotations

import os
import subprocess
import sys


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, as printed beside a measurement."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def pipetrain(*argv: str) -> str:
    """Run `python -m pipetrain ARGV` with OMP_NUM_THREADS=1; its output, or exit naming the failed command."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pipetrain", *argv], env=env, text=True, capture_output=True)
    if done.returncode:
        raise SystemExit(f"pipetrain {' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr
