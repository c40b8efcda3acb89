"""Benchmark: dp=2 DDP against dp=2 FSDP2 on gloo, measured and predicted (issue 18: FSDP's host cost per group).

For each row (model, global batch): `pipetrain train --pp 1 --dp 2 --chunks 1` with `--dp-mode ddp` and with
`--dp-mode fsdp`, alternately, `--repeats` times each (8 steps, the median step of steps 3-8; synthetic data),
and the planner's prediction of both from a calibration (`--calibration`, default: measured now with
`pipetrain plan --calibrate`, which measures FSDP2's fixed cost per parameter group and DTensor's optimizer
cost per tensor, bench/calibrate_fsdp.py and calibrate_tp.py). The classifier is planned from its analytic
model; the `lm` decoder from a profile (`pipetrain profile --workload lm`, sizes 1..micro-batch) with each
block's parameter-tensor count taken from the model. Printed: measured and predicted seconds and the
FSDP / DDP ratio of each, with the load average.

    PYTHONPATH=src python benchmarks/fsdp_host_cost.py --out runs/fsdp [--rows classifier:32,lm:16] [--calibration FILE]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

from pipetrain.logs.jsonl import read_records
from pipetrain.partition.profile import load_profile
from pipetrain.plan.hardware import load_calibration
from pipetrain.plan.model import config_blocks, profile_blocks
from pipetrain.plan.predict import Layout, predict
from pipetrain.workloads.classifier.presets import PRESETS
from pipetrain.workloads.registry import get_workload

from cli_runs import load_average, pipetrain

STEPS = 8



def _train(run: Path, workload: str, batch: int, mode: str) -> float:
    pipetrain("train", "--workload", workload, "--preset", "cpu", "--data", "synthetic", "--batch-size", str(batch),
               "--train-samples", str(batch * STEPS), "--test-samples", str(batch), "--epochs", "1",
               "--max-steps", str(STEPS), "--no-progress", "--log-every", "100", "--run-dir", str(run),
               "--pp", "1", "--dp", "2", "--chunks", "1", "--schedule", "gpipe", "--dp-mode", mode)
    return statistics.median([r["step_time_s"] for r in read_records(run / "steps.jsonl", "step")][2:])


def _blocks(workload: str, batch: int, out: Path):
    if workload == "classifier":
        return config_blocks(PRESETS["cpu"])
    path = out / f"profile-{workload}.json"
    if not path.exists():
        sizes = ",".join(str(1 << k) for k in range((batch // 2).bit_length()) if 1 << k <= batch // 2)
        pipetrain("profile", "--workload", workload, "--preset", "cpu", "--micro-batch-size", str(batch // 2),
                   "--sizes", sizes, "--output", str(path))
    model = get_workload(workload).model("cpu")
    counts = [len(list(model.build_block(i).parameters())) for i in range(model.num_blocks)]
    return [replace(b, tensors=n) for b, n in zip(profile_blocks(load_profile(path)), counts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/fsdp"))
    parser.add_argument("--rows", default="classifier:32,lm:16", help="MODEL:BATCH,... (default: classifier:32,lm:16)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calibration", type=Path, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load average at the start: {load_average()}")
    calibration = args.calibration
    if calibration is None:
        calibration = args.out / "calibration.json"
        pipetrain("plan", "--calibrate", "--gpus", "2", "--calibration", str(calibration))
    calib = load_calibration(calibration)
    print(f"calibration {calibration}: fsdp_group_s {calib.network.fsdp_group_s * 1e3:.2f} ms, optimizer_s_per_dtensor "
          f"{calib.device.optimizer_s_per_dtensor * 1e3:.3f} ms, collective latency "
          f"{calib.network.collective_latency_s * 1e3:.3f} ms")
    print("\n| model, batch | DDP measured s | FSDP measured s | FSDP/DDP measured | DDP predicted s | "
          "FSDP predicted s | FSDP/DDP predicted | FSDP/DDP predicted without the fixed costs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in args.rows.split(","):
        workload, batch = row.split(":")[0], int(row.split(":")[1])
        blocks = _blocks(workload, batch, args.out)
        measured = {"ddp": [], "fsdp": []}
        for repeat in range(args.repeats):
            for mode in ("ddp", "fsdp"):
                measured[mode].append(_train(args.out / f"{workload}-{batch}-{mode}-{repeat}", workload, batch, mode))
        got = {mode: statistics.median(times) for mode, times in measured.items()}
        plain = (replace(calib.device, optimizer_s_per_dtensor=0.0), replace(calib.network, fsdp_group_s=0.0))
        want, bare = {}, {}
        for mode in ("ddp", "fsdp"):
            layout = Layout(dp=2, pp=1, batch=batch, chunks=1, schedule="gpipe", dp_mode=mode)
            want[mode] = predict(blocks, layout, calib.device, calib.network).step_s
            bare[mode] = predict(blocks, layout, *plain).step_s
        runs = ", ".join(f"{m} " + "/".join(f"{t:.3f}" for t in ts) for m, ts in measured.items())
        print(f"| {workload}, {batch} ({runs}) | {got['ddp']:.3f} | {got['fsdp']:.3f} | {got['fsdp'] / got['ddp']:.2f} | "
              f"{want['ddp']:.3f} | {want['fsdp']:.3f} | {want['fsdp'] / want['ddp']:.2f} | "
              f"{bare['fsdp'] / bare['ddp']:.2f} |")
    print(f"\nload average at the end: {load_average()}")


if __name__ == "__main__":
    main()
