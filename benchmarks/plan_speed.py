"""How long `pipetrain plan` takes to plan 4,096 GPUs: the search alone (in this process, cold caches),
and the whole command as a user runs it (a fresh interpreter, built-in device figures).

    python benchmarks/plan_speed.py [--gpus 4096] [--batch 8192] [--repeats 5]
    python benchmarks/plan_speed.py --tp 1 2 4 8 --command-repeats 0   # the search with tensor parallelism too

`--tp` searches those degrees on nodes of 8 GPUs (what `pipetrain plan --gpus N` assumes) and passes nodes of
8 to the search; without it, the search is the pp × dp one of a single node, as first measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from pipetrain.plan.hardware import DEFAULT_DEVICE, DEFAULT_NETWORK
from pipetrain.plan.model import config_blocks
from pipetrain.plan.predict import clear_caches
from pipetrain.plan.search import SearchSpace, search
from pipetrain.workloads.classifier.presets import PRESETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--command-repeats", type=int, default=None, help="whole-command runs (default: --repeats)")
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="tensor-parallel degrees to search")
    args = parser.parse_args()
    space, per_node = (SearchSpace(), 0) if args.tp is None else (SearchSpace(tps=tuple(args.tp)), 8)
    blocks = config_blocks(PRESETS[args.preset])
    times, cpu = [], []
    for _ in range(args.repeats):
        clear_caches()  # every repeat starts cold
        start, start_cpu = time.perf_counter(), time.process_time()
        result = search(blocks, gpus=args.gpus, batch=args.batch, device=DEFAULT_DEVICE, network=DEFAULT_NETWORK,
                        space=space, gpus_per_node=per_node)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    tps = "" if args.tp is None else f", tp {args.tp} on nodes of 8"
    print(f"{args.gpus} GPUs{tps}, preset {args.preset}, batch {args.batch}: {result.enumerated} layouts, "
          f"{result.simulated} simulated; search median {statistics.median(times):.3f} s, "
          f"min {min(times):.3f} s, max {max(times):.3f} s over {args.repeats} runs (CPU time: median "
          f"{statistics.median(cpu):.3f} s, which a loaded machine inflates less)")
    command = [sys.executable, "-m", "pipetrain", "plan", "--gpus", str(args.gpus), "--preset", args.preset,
               "--batch", str(args.batch), "--gpu-mem", "80"]
    walls = []
    repeats = args.repeats if args.command_repeats is None else args.command_repeats
    if not repeats:
        return
    with tempfile.TemporaryDirectory() as home:  # no calibration file: the built-in GPU figures
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, env={**os.environ, "HOME": home})
            walls.append(time.perf_counter() - start)
    print(f"the whole command ({' '.join(command[2:])}): median {statistics.median(walls):.3f} s wall, "
          f"min {min(walls):.3f} s, max {max(walls):.3f} s")


if __name__ == "__main__":
    main()
