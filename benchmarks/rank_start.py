"""How long `pipetrain train` takes to start its own ranks: forked from the fork server (the default,
launch/forkserver.py) against a fresh interpreter per rank (PIPETRAIN_START_METHOD=spawn), side by side.

Each round runs the same tiny job once each way, in alternation (the machine's load drifts), and records the whole
command's wall time and rank 0's `start-up:` total (launch to the end of the first step). Prints the medians and
their ratio per layout:

    python benchmarks/rank_start.py --layouts 1x2 2x2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from cli_runs import load_average  # noqa: E402

JOB = ("train", "--preset", "tiny", "--data", "synthetic", "--train-samples", "64", "--test-samples", "16",
       "--batch-size", "16", "--epochs", "1", "--no-progress")
METHODS = ("forkserver", "spawn")


def run_once(dp: int, pp: int, method: str) -> tuple[float, float]:
    """(the command's wall seconds, rank 0's start-up seconds) of one job started `method`'s way."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPETRAIN_START_METHOD": method}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pipetrain", *JOB, "--dp", str(dp), "--pp", str(pp)], env=env,
                          text=True, capture_output=True)
    wall = time.monotonic() - start
    found = re.search(r"start-up: ([\d.]+) s", done.stdout + done.stderr)
    if done.returncode or not found:
        raise SystemExit(f"the {method} job (dp={dp}, pp={pp}) failed:\n{done.stdout}{done.stderr}")
    return wall, float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["1x2", "2x2"], help="DPxPP of each job (default: 1x2 2x2)")
    parser.add_argument("--rounds", type=int, default=3, help="jobs per start method and layout (default 3)")
    args = parser.parse_args()
    print(f"load average before: {load_average()}")
    print("| dp x pp | ranks | fork server: wall s / start-up s | spawn: wall s / start-up s | wall ratio | "
          "start-up ratio |\n| --- | ---: | --- | --- | ---: | ---: |")
    for layout in args.layouts:
        dp, pp = (int(x) for x in layout.split("x"))
        runs: dict[str, list[tuple[float, float]]] = {method: [] for method in METHODS}
        for _ in range(args.rounds):
            for method in METHODS:
                runs[method].append(run_once(dp, pp, method))
        wall = {m: statistics.median(w for w, _ in runs[m]) for m in METHODS}
        up = {m: statistics.median(s for _, s in runs[m]) for m in METHODS}
        print(f"| {dp} x {pp} | {dp * pp} | {wall['forkserver']:.2f} / {up['forkserver']:.2f} | "
              f"{wall['spawn']:.2f} / {up['spawn']:.2f} | {wall['forkserver'] / wall['spawn']:.2f} | "
              f"{up['forkserver'] / up['spawn']:.2f} |")
    print(f"load average after: {load_average()}  (medians of {args.rounds} alternating runs; ratio < 1: the fork "
          "server is faster)")


if __name__ == "__main__":
    main()
