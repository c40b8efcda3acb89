"""Start-up cost across two hosts: seconds from launch to the first finished step for 2, 4 and 8 ranks split over
two network-namespace hosts (scripts/netns-cluster.sh; needs root), beside the cost of importing pipetrain alone,
and rank 0's split of it by phase (the `start-up:` line every run logs once, pipetrain/logs/startup.py).

    sudo python benchmarks/multihost_startup.py [--ranks 2 4 8]

Each job is `pipetrain train` (tiny preset, synthetic data, pp=2 across the hosts, dp = ranks/2) with the ranks'
variables set by hand; the first step is the first record of the run's steps.jsonl. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.netns_cluster import ADDRESSES, MASTER_PORT, Cluster, environ, losses, wait_all, wait_for  # noqa: E402

JOB = ["-m", "pipetrain", "train", "--preset", "tiny", "--data", "synthetic", "--schedule", "gpipe", "--chunks", "2",
       "--batch-size", "16", "--train-samples", "64", "--test-samples", "16", "--epochs", "1", "--max-steps", "2",
       "--no-progress", "--pp", "2"]


def import_seconds() -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import pipetrain.cli.train_run"], env=environ(), check=True, timeout=300)
    return time.monotonic() - start


def phases(text: str) -> dict[str, float]:
    """The phases of a rank's `start-up:` line (logs/startup.py), name -> seconds; empty without one."""
    line = next((ln for ln in text.splitlines() if "pipetrain: start-up:" in ln), "")
    return {name.strip(): float(value) for name, value in re.findall(r"([a-z+ ]+?) ([0-9.]+) s(?: \||$)", line.split(": ", 2)[-1])}


def first_step_seconds(cluster: Cluster, ranks: int, folder: Path) -> tuple[float, dict[str, float]]:
    run_dir = folder / f"run{ranks}"
    common = {"WORLD_SIZE": str(ranks), "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": ADDRESSES[0],
              "MASTER_PORT": str(MASTER_PORT), "LOCAL_WORLD_SIZE": str(ranks // 2)}
    start = time.monotonic()
    processes = [cluster.start(rank % 2, [sys.executable, *JOB, "--dp", str(ranks // 2), "--run-dir", str(run_dir)],
                               environ(**common, RANK=str(rank), LOCAL_RANK=str(rank // 2), GROUP_RANK=str(rank % 2)),
                               f"start{ranks}-rank{rank}.log")
                 for rank in range(ranks)]
    if not wait_for(lambda: bool(losses(run_dir)), 600.0, poll_s=0.05):
        raise SystemExit(f"{ranks} ranks: no step within 600 s:\n{cluster.output(f'start{ranks}-rank0.log')[-3000:]}")
    seconds = time.monotonic() - start
    codes = wait_all(processes, 300.0)
    if codes != [0] * ranks:
        raise SystemExit(f"{ranks} ranks ended with {codes}:\n{cluster.output(f'start{ranks}-rank0.log')[-3000:]}")
    return seconds, phases(cluster.output(f"start{ranks}-rank0.log"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    alone, load_before = import_seconds(), os.getloadavg()[0]  # first: the jobs below load the machine
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(name=f"bs{os.getpid() % 100000}", folder=Path(tmp))
        cluster.up()
        try:
            rows = [(n, first_step_seconds(cluster, n, Path(tmp))) for n in args.ranks]
        finally:
            cluster.down()
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores; "
          f"`import pipetrain.cli.train_run` alone (before the jobs): {alone:.1f} s")
    print("| ranks (over 2 hosts) | layout | launch → first step (s) | per rank (s) |")
    print("| --- | --- | --- | --- |")
    for n, (seconds, _) in rows:
        print(f"| {n} | dp={n // 2} × pp=2 (pp across the hosts) | {seconds:.1f} | {seconds / n:.1f} |")
    names = list(dict.fromkeys(name for _, (_, split) in rows for name in split))
    print("\nrank 0's start-up by phase (s; `imports+data`: the process's age when its session opens)\n")
    print("| ranks | " + " | ".join(names) + " | sum | launch → first step |")
    print("| --- | " + " | ".join("---" for _ in names) + " | --- | --- |")
    for n, (seconds, split) in rows:
        cells = " | ".join(f"{split.get(name, float('nan')):.2f}" for name in names)
        print(f"| {n} | {cells} | {sum(split.values()):.1f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
