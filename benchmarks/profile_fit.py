"""One-size profiles rescaled linearly against profiles fitted over several micro-batch sizes, on the `lm` preset.

The setup of issue 18's measurement: `pipetrain profile --workload lm` (once at micro-batch 8 alone, the old way;
once at sizes 1 ... 32, fitted per block as a fixed + a per-sample cost), a fresh calibration, then the pp=2,
batch 32 cells (GPipe and 1F1B, 1-8 chunks) measured by `pipetrain bench` and predicted from each profile.
Prints each cell's measured and two predicted step times and the median |error| of each profile, then each
profile's per-block total at micro-batch sizes 3, 6, 12 and 24 (which neither profile measured) measured on their
own against what each predicts there.

    python benchmarks/profile_fit.py --out runs/profile-fit [--calibration FILE]   # about 5 minutes on 2 cores

Steps already done in `--out` (profiles, calibration, bench cells) are reused: delete the folder to measure anew.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from pipetrain.bench.results import ResultStore
from pipetrain.config import SCHEDULES
from pipetrain.partition.profile import load_profile
from pipetrain.plan.hardware import load_calibration
from pipetrain.plan.model import profile_blocks
from pipetrain.plan.predict import Layout, predict


def _pipetrain(*argv: str) -> None:
    print("$ pipetrain " + " ".join(argv), flush=True)
    subprocess.run([sys.executable, "-m", "pipetrain", *argv], check=True, env=os.environ.copy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/profile-fit"))
    parser.add_argument("--calibration", type=Path, default=None, help="default: measure one into --out")
    parser.add_argument("--sizes", default="1,2,4,8,16,32", help="sizes of the fitted profile")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    one, fitted = out / "lm-one-size.json", out / "lm-fitted.json"
    if not one.exists():
        _pipetrain("profile", "--workload", "lm", "--preset", "cpu", "--micro-batch-size", "8", "--sizes", "8",
                   "-o", str(one))
    if not fitted.exists():
        _pipetrain("profile", "--workload", "lm", "--preset", "cpu", "--micro-batch-size", "8", "--sizes", args.sizes,
                   "-o", str(fitted))
    calibration = args.calibration or out / "calibration.json"
    if not calibration.exists():
        _pipetrain("plan", "--calibrate", "--gpus", "2", "--calibration", str(calibration))
    bench = out / "bench"
    if not (bench / "cells.jsonl").exists():
        _pipetrain("bench", "--workload", "lm", "--grid", "preset=cpu", "--grid", "pp=2", "--grid", "dp=1",
                   "--grid", "batch=32", "--grid", "chunks=1,2,4,8", "--grid", "schedule=gpipe,1f1b",
                   "--grid", "checkpoint=never", "--out", str(bench))
    calib = load_calibration(calibration)
    sources = {"one size, linear": profile_blocks(load_profile(one)), "fitted": profile_blocks(load_profile(fitted))}
    errors: dict[str, list[float]] = {name: [] for name in sources}
    print(f"\n{'cell':<28} {'measured s':>10} " + " ".join(f"{name:>18}" for name in sources))
    for result in sorted((r for r in ResultStore(bench / "cells.jsonl").load().values() if r.ok),
                         key=lambda r: (r.cell.schedule, r.cell.chunks)):
        cell = result.cell
        layout = Layout(dp=cell.dp, pp=cell.pp, batch=cell.batch_size, chunks=cell.chunks, schedule=cell.schedule,
                        virtual=SCHEDULES[cell.schedule], checkpoint=cell.checkpoint)
        measured = result.median_step_s
        row = []
        for name, blocks in sources.items():
            predicted = predict(blocks, layout, calib.device, calib.network).step_s
            errors[name].append((predicted - measured) / measured)
            row.append(f"{predicted:>8.3f} ({100 * errors[name][-1]:+5.1f}%)")
        print(f"{cell.schedule + ' chunks=' + str(cell.chunks):<28} {measured:>10.3f} " + " ".join(f"{r:>18}" for r in row))
    for name, values in errors.items():
        print(f"{name}: median error {100 * statistics.median(values):+.1f}%, median |error| "
              f"{100 * statistics.median(abs(v) for v in values):.1f}%, max |error| {100 * max(map(abs, values)):.1f}%")
    _held_out(out, load_profile(one), load_profile(fitted))


def _held_out(out: Path, one, fitted) -> None:
    """Each profile's forward + backward total at micro-batch sizes measured on their own afterwards (CPU time per
    block: what the rescaling or the fit has to predict, without the pipeline's and the machine's noise)."""
    print(f"\n{'micro-batch':>11} {'measured ms':>12} {'one size, linear':>18} {'fitted':>18}")
    errors: dict[str, list[float]] = {"linear": [], "fitted": []}
    for size in (3, 6, 12, 24):
        path = out / f"lm-held-out-{size}.json"
        if not path.exists():
            _pipetrain("profile", "--workload", "lm", "--preset", "cpu", "--micro-batch-size", str(size),
                       "--sizes", str(size), "-o", str(path))
        measured = sum(b.time_s for b in load_profile(path).blocks)
        row = []
        for name, profile in (("linear", one), ("fitted", fitted)):
            predicted = sum(b.time_s for b in profile.rescaled(size).blocks)
            errors[name].append((predicted - measured) / measured)
            row.append(f"{predicted * 1e3:>8.1f} ({100 * errors[name][-1]:+5.1f}%)")
        print(f"{size:>11} {measured * 1e3:>12.1f} " + " ".join(f"{r:>18}" for r in row))
    for name, values in errors.items():
        print(f"held-out sizes, {name}: median |error| {100 * statistics.median(abs(v) for v in values):.1f}%")


if __name__ == "__main__":
    main()
