"""Benchmark: tensor parallelism against the pipeline and data parallelism on 2 CPU ranks (the `cpu` preset).

One run, four cells of `pipetrain bench` (each in fresh rank processes, `pipetrain.bench.runner.run_cell`):
`pp1` (the whole model on one rank: the baseline), `tp2` (each layer split over 2 ranks), `pp2` (2 stages,
GPipe, 4 micro-batches) and `dp2` (2 DDP replicas), the same global batch of synthetic reviews. Printed: the
median step time, its ratio to pp1 and to tp2, and the peak memory per rank (the most of any rank).

What a CPU can show: that tp2 trains (parity is in tests/distributed/test_tp_parity.py), its per-rank memory of
the split weights, and what its two all-reduces per layer forward and two backward cost over gloo on loopback.
What it cannot: the NVLink bandwidth that makes TP pay within a GPU node; on 2 shared cores gloo's all-reduces
of every layer's activations are slow next to the layer's arithmetic, so tp2 is expected to lose here.
Run: `.venv/bin/python benchmarks/tp.py [--batch-size 64] [--steps 6]`.
"""

from __future__ import annotations

import argparse
import os

from pipetrain.bench.grid import Cell
from pipetrain.bench.runner import run_cell

CELLS = {
    "pp1": {"pp": 1},
    "tp2": {"pp": 1, "tp": 2},
    "pp2": {"pp": 2, "chunks": 4},
    "dp2": {"pp": 1, "dp": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    results = {}
    for name, fields in CELLS.items():
        cell = Cell(batch_size=args.batch_size, preset=args.preset, **fields)
        results[name] = run_cell(cell, warmup=args.warmup, steps=args.steps, timeout_s=900, device="cpu")
    load = os.getloadavg()[0]
    print(f"preset {args.preset}, global batch {args.batch_size}, {args.steps} timed steps after {args.warmup} "
          f"warm-up, 2 CPU cores (1-min load average at the end: {load:.1f})\n")
    print("| layout | ranks | median step (s) | vs pp1 | vs tp2 | peak memory per rank (MB) |")
    print("|---|---|---|---|---|---|")
    base, tp = results["pp1"].median_step_s, results["tp2"].median_step_s
    for name, result in results.items():
        if result.status != "ok":
            print(f"| {name} | {result.cell.world_size} | {result.status}: {result.reason} | | | |")
            continue
        step = result.median_step_s
        peak = max(result.peak_mem_mb_per_stage or [float("nan")])
        print(f"| {name} | {result.cell.world_size} | {step:.3f} | {base / step:.2f}x | {tp / step:.2f}x | {peak:.0f} |")
    print("\nvs pp1: pp1's step time / this layout's (> 1 is faster); vs tp2 likewise against tp2.")


if __name__ == "__main__":
    main()
