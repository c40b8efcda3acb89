"""Validate `pipetrain plan`'s simulator against `pipetrain bench` measurements on this machine.

For every "ok" cell of one or more bench result folders (their `cells.jsonl`), predict the step time and
the per-stage peak memory with the analytic model of the cell's preset and a calibration file, then print
per cell and in total: the median absolute relative error of the step time, Spearman's rank correlation
of the cells within each (pp, batch) row, and the memory error per stage, both of the whole process
(CPU: VmHWM, which the bench measures) and of the memory above the rank's baseline (what the model
allocates: measured peak minus the calibrated baseline, against the prediction minus the same baseline).

    pipetrain bench --out runs/default                   # the default grid (~8 min idle)
    pipetrain bench --grid pp=4 --out runs/pp4           # a second grid: the pp=4 cells
    pipetrain plan --calibrate --gpus 2                  # stores ~/.cache/pipetrain/calibration.json
    python benchmarks/plan_validation.py runs/default runs/pp4 [--calibration FILE]

A cell found in several folders (the same grid run again) is compared by the median of its runs, and
several `--calibration` files give the median prediction: this machine's speed drifts by more than 10 %
between runs minutes apart, and repeated runs on both sides average that drift out.

Tensor-parallel cells: a cell with a `tp` field above 1 (the bench grid's tp axis, once the engine has one;
`sequence_parallel` read the same way) is predicted at that tp. When any cell has tp > 1 the rows compared by
Spearman are (ranks, batch), so tp2, pp2 and dp2 cells of one batch are ranked against each other, and the
tp cells' own step-time error is printed apart, and each tp cell's step time over the same cell's at tp = 1
(measured against predicted). Cells without the field are tp = 1, as before; dp > 1 with tp > 1 is FSDP (the
bench's pairing), tp = 1 DDP.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

from pipetrain.bench.results import ResultStore
from pipetrain.config import SCHEDULES
from pipetrain.plan.hardware import default_calibration_path, load_calibration
from pipetrain.plan.model import config_blocks
from pipetrain.plan.predict import Layout, predict
from pipetrain.workloads.classifier.presets import PRESETS

MB = 2**20


def tensor_axes(cell) -> tuple[int, bool]:
    """(tp, sequence parallelism) of a bench cell: (1, False) for cells of a bench without those axes."""
    return int(getattr(cell, "tp", 1) or 1), bool(getattr(cell, "sequence_parallel", False))


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho (average ranks for ties); nan for fewer than 3 points."""
    if len(xs) < 3:
        return float("nan")

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def _measured(folders: list[Path]) -> dict:
    """Each ok cell's results over the folders (a cell measured in several folders: its repeated runs)."""
    cells: dict = {}
    for folder in folders:
        for result in ResultStore(folder / "cells.jsonl").load().values():
            if result.ok:
                cells.setdefault(result.cell, []).append(result)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="bench output folders (with cells.jsonl)")
    parser.add_argument("--calibration", type=Path, nargs="+", default=[default_calibration_path()],
                        help="one or more calibration files (several: the median prediction)")
    args = parser.parse_args()
    calibs = [load_calibration(path) for path in args.calibration]
    base = statistics.median(c.device.baseline_bytes for c in calibs) / MB
    rows: dict[tuple[int, int], list[tuple[float, float]]] = {}
    steps: dict = {}  # cell -> (measured, predicted), for the tp cells against their tp=1 counterparts
    time_errors, mem_errors, above_errors, noise, rerun, tp_errors = [], [], [], [], [], []
    cells = _measured(args.folders)
    by_ranks = any(tensor_axes(cell)[0] > 1 for cell in cells)
    for path, calib in zip(args.calibration, calibs):
        print(f"calibration: {path} ({calib.measured})")
    print(f"{'cell':<48} {'measured s':>10} {'predicted':>10} {'error':>7}  memory MB measured/predicted per stage")
    for cell, results in cells.items():
        tp, sp = tensor_axes(cell)
        layout = Layout(dp=cell.dp, pp=cell.pp, batch=cell.batch_size, chunks=cell.chunks, schedule=cell.schedule,
                        virtual=SCHEDULES[cell.schedule], checkpoint=cell.checkpoint, tp=tp, sequence_parallel=sp,
                        dp_mode=getattr(cell, "dp_mode", "ddp"))
        blocks = config_blocks(PRESETS[cell.preset])
        predictions = [predict(blocks, layout, c.device, c.network) for c in calibs]
        predicted = statistics.median(p.step_s for p in predictions)
        measured = statistics.median(r.median_step_s for r in results)
        error = (predicted - measured) / measured
        noise.extend((r.step_s_spread or 0.0) / r.median_step_s for r in results)
        if len(results) > 1:
            rerun.append((max(r.median_step_s for r in results) - min(r.median_step_s for r in results)) / measured)
        time_errors.append(abs(error))
        steps[cell] = (measured, predicted)
        if tp > 1:
            tp_errors.append(abs(error))
        rows.setdefault((layout.world_size if by_ranks else cell.pp, cell.batch_size), []).append((measured, predicted))
        measured_mem = [statistics.median(stage) for stage in zip(*(r.peak_mem_mb_per_stage for r in results))]
        predicted_mem = [statistics.median(stage) / MB for stage in zip(*(p.memory_bytes for p in predictions))]
        for got, want in zip(measured_mem, predicted_mem):
            mem_errors.append(abs(want - got) / got)
            above_errors.append(abs((want - base) - (got - base)) / max(got - base, 1.0))
        name = f"pp={cell.pp} {cell.schedule} batch={cell.batch_size} chunks={cell.chunks} {cell.checkpoint}"
        if by_ranks:
            name = f"dp={cell.dp} tp={tp}{'sp' if sp else ''} " + name
        mems = " ".join(f"{g:.0f}/{w:.0f}" for g, w in zip(measured_mem, predicted_mem))
        print(f"{name:<48} {measured:>10.3f} {predicted:>10.3f} {100 * error:>+6.1f}%  {mems}")
    print(f"\ncells: {len(time_errors)}")
    print(f"step time: median |error| {100 * statistics.median(time_errors):.1f}%, "
          f"mean {100 * statistics.fmean(time_errors):.1f}%, max {100 * max(time_errors):.1f}%")
    print(f"measurement noise: median over cells of the steps' interquartile range / median step time "
          f"{100 * statistics.median(noise):.1f}% (max {100 * max(noise):.1f}%)")
    if rerun:
        print(f"repeated runs of a cell: median (slowest - fastest) / median {100 * statistics.median(rerun):.1f}% "
              f"(max {100 * max(rerun):.1f}%) over {len(rerun)} cells")
    if tp_errors:
        print(f"tensor-parallel cells: {len(tp_errors)}, step time median |error| {100 * statistics.median(tp_errors):.1f}%, "
              f"max {100 * max(tp_errors):.1f}%")
    pairs = [(cell, steps[cell], steps[replace(cell, tp=1)]) for cell in steps
             if tensor_axes(cell)[0] > 1 and replace(cell, tp=1) in steps]
    if pairs:
        print("tp cells against the same cell at tp=1 (step-time ratio; the machine's drift between the two cancels "
              "in part):")
        ratio_errors = []
        for cell, (m_tp, p_tp), (m_one, p_one) in pairs:
            got, want = m_tp / m_one, p_tp / p_one
            ratio_errors.append(abs(want - got) / got)
            print(f"  dp={cell.dp} pp={cell.pp} batch={cell.batch_size} chunks={cell.chunks}: measured {got:.2f}, "
                  f"predicted {want:.2f} ({100 * (want - got) / got:+.0f}%)")
        print(f"  median |error| of the ratio {100 * statistics.median(ratio_errors):.1f}% over {len(pairs)} pairs")
    for key in sorted(rows):
        measured, predicted = zip(*rows[key])
        print(f"  row {'ranks' if by_ranks else 'pp'}={key[0]} batch={key[1]}: {len(measured)} cells, "
              f"Spearman {spearman(list(measured), list(predicted)):+.2f}")
    print(f"peak memory per stage (whole process): median |error| {100 * statistics.median(mem_errors):.1f}%, "
          f"max {100 * max(mem_errors):.1f}%")
    print(f"peak memory above the {base:.0f} MB baseline: median |error| "
          f"{100 * statistics.median(above_errors):.1f}%, max {100 * max(above_errors):.1f}%")


if __name__ == "__main__":
    main()
