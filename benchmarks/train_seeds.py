"""`make train`'s recipe over several seeds: held-out accuracy and wall time per candidate and seed.

Each candidate is a string of `pipetrain train` flags added to the defaults ("" is the default itself). Every
candidate runs once per seed, the whole command timed (as `make train` is); within each seed the candidates
take turns in a rotated order (seed 0: A B C, seed 1: B C A, ...), so a drift of the shared machine's load
hits them all alike. Accuracy does not depend on the load; the times do, so the load average is printed
before and after each run. Prints per candidate each seed's held-out accuracy and time, the mean and the
range (max - min); writes one JSON line per run, then one per candidate, to OUT/runs.jsonl.

    PYTHONPATH=src python benchmarks/train_seeds.py --out runs/seeds --seeds 0 1 2 \\
        --candidates "" "--lr-schedule cosine --warmup-steps 30" "--lr-schedule wsd"   # ~5 min per run
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from pathlib import Path

from cli_runs import load_average, pipetrain


def _run(out: Path, index: int, flags: str, seed: int) -> dict:
    """One `pipetrain train` with `flags` and `seed`: its last epoch's held-out figures and the command's wall time."""
    name = f"c{index}-seed{seed}"
    metrics = out / f"{name}.json"
    before = load_average()
    start = time.perf_counter()
    pipetrain("train", *shlex.split(flags), "--seed", str(seed), "--metrics", str(metrics), "--no-progress",
              "--run-dir", str(out / name))
    wall = time.perf_counter() - start
    last = json.loads(metrics.read_text())[-1]
    return {"candidate": flags, "seed": seed, "accuracy": last["test_accuracy"], "loss": last["test_loss"],
            "split": last["eval_split"], "epoch_s": round(last["seconds"], 1), "wall_s": round(wall, 1),
            "load_before": before, "load_after": load_average()}


def _minutes(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidates", nargs="+", default=[""], metavar="FLAGS",
                        help='strings of train flags, "" for the defaults (default: the defaults alone); write a lone '
                             'flag with a leading space, " --no-bucket", or argparse takes it for an option')
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs/seeds"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.jsonl"
    runs: dict[tuple[int, int], dict] = {}
    n = len(args.candidates)
    for turn, seed in enumerate(args.seeds):
        for index in [(turn + k) % n for k in range(n)]:
            row = runs[index, seed] = _run(args.out, index, args.candidates[index], seed)
            print(f"{args.candidates[index] or '(default)'}  seed {seed}: {row['split']} acc {row['accuracy']:.3f}"
                  f"  {row['wall_s']:.0f} s  (load {row['load_before']} -> {row['load_after']})", flush=True)
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print("\ncandidate | " + " | ".join(f"seed {s}: acc, time" for s in args.seeds) + " | mean | range")
    for index, flags in enumerate(args.candidates):
        rows = [runs[index, seed] for seed in args.seeds]
        accs = [r["accuracy"] for r in rows]
        summary = {"candidate": flags, "seeds": args.seeds, "accuracies": accs, "mean": statistics.mean(accs),
                   "range": max(accs) - min(accs), "min": min(accs)}
        cells = " | ".join(f"{r['accuracy']:.3f}, {_minutes(r['wall_s'])}" for r in rows)
        print(f"{flags or '(default)'} | {cells} | {summary['mean']:.3f} | {summary['range']:.3f}")
        with log.open("a") as f:
            f.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
