"""`--layout auto` against the README's default layout and the best cell of a grid, measured side by side.

For each model (the `cpu` classifier preset and the `lm` preset) and two global batch sizes, on 2 ranks:

- auto: `pipetrain train --layout auto` with a profile fitted over micro-batch sizes 1-32 and one calibration
  (both made once at the start, or given), the layout it chose read from its log;
- default: the README's `pipetrain train` layout (pp=2, 1F1B, 4 chunks, no recomputation, uniform split);
- grid: pp=2 × {GPipe 1, 2, 4, 8 chunks; 1F1B 2, 4, 8 chunks} and dp=2 (DDP) × pp=1, no recomputation, uniform;
  its best cell is then run twice more: the spread of its three runs is the grid's run-to-run noise.

Every run is the same `pipetrain train` (synthetic data, 8 steps, 1 thread per rank), timed by its own
steps.jsonl: the median step time of steps 3-8. Prints per row auto / default and auto / grid best, the chosen
layout, and the load average before and after (the CPU is shared).

    python benchmarks/auto_layout.py --out runs/auto-layout [--calibration FILE]   # ~15 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pipetrain.logs.jsonl import read_records

from cli_runs import load_average, pipetrain

ROWS = (("classifier", 32), ("classifier", 64), ("lm", 16), ("lm", 32))
DEFAULT = ("--pp", "2", "--dp", "1", "--schedule", "1f1b", "--chunks", "4")
GRID = ([("--pp", "2", "--dp", "1", "--schedule", "gpipe", "--chunks", str(c)) for c in (1, 2, 4, 8)]
        + [("--pp", "2", "--dp", "1", "--schedule", "1f1b", "--chunks", str(c)) for c in (2, 4, 8)]
        + [("--pp", "1", "--dp", "2", "--schedule", "gpipe", "--chunks", "1")])
STEPS = 8



def _train(out: Path, name: str, workload: str, batch: int, flags: tuple[str, ...]) -> tuple[float, str]:
    run = out / name
    log = pipetrain("train", "--workload", workload, "--preset", "cpu", "--data", "synthetic", "--batch-size",
                     str(batch), "--train-samples", str(batch * STEPS), "--test-samples", str(batch), "--epochs", "1",
                     "--max-steps", str(STEPS), "--no-progress", "--log-every", "100", "--run-dir", str(run), *flags)
    times = [r["step_time_s"] for r in read_records(run / "steps.jsonl", "step")][2:]
    return statistics.median(times), log


def _rows(text: str) -> tuple[tuple[str, int], ...]:
    """`--rows lm:16,classifier:64`."""
    return tuple((model, int(batch)) for model, batch in (item.split(":") for item in text.split(",")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/auto-layout"))
    parser.add_argument("--calibration", type=Path, default=None, help="default: measure one into --out")
    parser.add_argument("--rows", type=_rows, default=ROWS, metavar="MODEL:BATCH,...",
                        help="the rows to measure, e.g. lm:16,classifier:64 (default: all four)")
    args = parser.parse_args()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {load_average()}", flush=True)
    calibration = args.calibration or out / "calibration.json"
    if not calibration.exists():
        pipetrain("plan", "--calibrate", "--gpus", "2", "--calibration", str(calibration))
    summary = []
    for workload, batch in args.rows:
        profile = out / f"{workload}-profile.json"
        if not profile.exists():
            pipetrain("profile", "--workload", workload, "--preset", "cpu", "--micro-batch-size", "16",
                       "--sizes", "1,2,4,8,16,32", "-o", str(profile))
        row = f"{workload}-b{batch}"
        auto_s, log = _train(out, f"{row}-auto", workload, batch, ("--layout", "auto", "--profile", str(profile),
                                                                  "--calibration", str(calibration)))
        chose = next(line for line in log.splitlines() if "--layout auto chose" in line)
        chosen = chose.split("chose ")[1].split(" for ")[0]
        predicted = next(line for line in log.splitlines() if "pipetrain: predicted" in line).split()[2]
        cells = {}
        for flags in GRID:
            name = " ".join(flags)
            cells[name] = _train(out, f"{row}-" + "-".join(flags[1::2]), workload, batch, flags)[0]
        best = min(cells, key=cells.get)
        repeats = [cells[best]] + [_train(out, f"{row}-best-{i}", workload, batch, tuple(best.split()))[0]
                                   for i in (1, 2)]
        default_s = cells[" ".join(DEFAULT)]
        noise = (max(repeats) - min(repeats)) / statistics.median(repeats)
        best_s = statistics.median(repeats)
        line = {"row": row, "auto": chosen, "auto_s": auto_s, "predicted_s": float(predicted), "default_s": default_s,
                "best": best, "best_s": best_s, "best_runs": repeats, "noise": noise, "grid": cells}
        summary.append(line)
        print(f"{row}: auto {auto_s:.3f} s ({chosen}; predicted {predicted} s) | default {default_s:.3f} s | grid best "
              f"{best_s:.3f} s ({best}; 3 runs {', '.join(f'{r:.3f}' for r in repeats)}, spread {100 * noise:.0f} %) | "
              f"auto/default {auto_s / default_s:.2f}, auto/best {auto_s / best_s:.2f} | load {load_average()}", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
