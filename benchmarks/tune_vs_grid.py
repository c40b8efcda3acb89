"""`pipetrain tune` on the pp=2 part of the default bench grid, against that grid's measurements.

For each batch of the grid (pp=2, gpipe, no recomputation, chunks 1..16), run `pipetrain tune` restricted
to the same cells, then look its chosen layout up in the bench results: the grid-measured step time of
tune's pick against the grid's measured best of that row, and tune's cost (cell-steps, warm-up included)
against the grid's (cells x (2 warm-up + 5 timed steps), the bench defaults).

    pipetrain bench --out runs/default                   # the default grid, once
    python benchmarks/tune_vs_grid.py runs/default [runs/default-again ...] [--calibration FILE] [--out runs/tune]
        [-- TUNE OPTIONS]

Several bench folders: the grid's cells are their median over the runs (a less noisy reference), and each
run's own best is looked up in that median too: how often one whole grid run, at 100 % of the cost,
misses the best by more than 5 % on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from pipetrain.bench.results import ResultStore

GRID_CELL_STEPS = 2 + 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", type=Path, nargs="+",
                        help="the default bench's output folder (several: runs of it, compared by their median)")
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("tune-out"))
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: options for every `pipetrain tune`
    args = parser.parse_args(argv[:cut])
    args.tune_options = argv[cut + 1:]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    per_run: list[dict] = []  # each folder's ok cells
    for folder in args.bench:
        per_run.append({})
        for r in ResultStore(folder / "cells.jsonl").load().values():
            if r.cell.pp == 2 and r.cell.dp == 1 and r.cell.schedule == "gpipe" and r.cell.checkpoint == "never":
                runs.setdefault(r.cell, []).append(r)
                if r.ok:
                    per_run[-1][r.cell] = r.median_step_s
    grid = list(runs)
    batches = sorted({c.batch_size for c in grid})
    tune_cost = grid_cost = 0
    worst = 0.0
    for batch in batches:
        row = {c.chunks: runs[c] for c in grid if c.batch_size == batch}
        out = args.out / f"tune-batch{batch}.json"
        command = [sys.executable, "-m", "pipetrain", "tune", "--gpus", "2", "--pp", "2", "--preset", "cpu",
                   "--batch", str(batch), "--schedules", "gpipe", "--checkpoints", "never",
                   "--max-chunks", str(max(row)), "--out", str(out)]
        if args.calibration:
            command += ["--calibration", str(args.calibration)]
        command += args.tune_options
        subprocess.run(command, check=True)
        tuned = json.loads(out.read_text())
        ok = {c: statistics.median(r.median_step_s for r in rs if r.ok) for c, rs in row.items() if any(r.ok for r in rs)}
        best_chunks = min(ok, key=ok.get)
        pick = tuned["best"]["chunks"]
        gap = ok[pick] / ok[best_chunks] - 1
        worst = max(worst, gap)
        cells = len(row)
        tune_cost += tuned["cell_steps"]
        grid_cost += cells * GRID_CELL_STEPS
        print(f"batch {batch}: tune picked chunks={pick} (grid-measured {ok[pick]:.3f} s), grid best chunks={best_chunks} "
              f"({ok[best_chunks]:.3f} s): {100 * gap:+.1f}%; cost {tuned['cell_steps']} of {cells * GRID_CELL_STEPS} "
              f"cell-steps; speed-up over naive measured by tune {tuned['speedup']:.2f}x")
        if len(args.bench) > 1:  # the same yardstick for one whole grid run: its own pick, looked up in the median
            picks = [min((c for c in measured if c.batch_size == batch), key=measured.get).chunks
                     for measured in per_run if any(c.batch_size == batch for c in measured)]
            alone = [ok[chunks] / ok[best_chunks] - 1 for chunks in picks]
            print(f"  each whole grid run's own pick, in the same terms: "
                  + ", ".join(f"{100 * g:+.1f}%" for g in alone))
    print(f"\nworst gap to the grid's best: {100 * worst:.1f}%; search cost {tune_cost} of {grid_cost} cell-steps "
          f"({100 * tune_cost / grid_cost:.0f}%)")


if __name__ == "__main__":
    main()
