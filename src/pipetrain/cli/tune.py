"""`pipetrain tune`: plan, then measure the most promising layouts on this machine by successive halving."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from pipetrain.bench.grid import Cell, cell_problem
from pipetrain.bench.runner import run_cell
from pipetrain.cli.device_args import device_choice
from pipetrain.cli.plan import add_plan_arguments, planned
from pipetrain.errors import ConfigError
from pipetrain.plan.halving import successive_halving
from pipetrain.plan.layout import Layout
from pipetrain.plan.search import enumerate_layouts

__all__ = ["add_parser", "run"]

log = logging.getLogger("pipetrain")

#: The cost of measuring one cell in `pipetrain bench` (its default warm-up + timed steps), for the grid cost.
GRID_CELL_STEPS = 2 + 5


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("tune", help=__doc__, description=__doc__ + (
        " Layouts are those a bench cell can run: DDP, uniform balance, the schedule's default virtual stages."))
    add_plan_arguments(parser)
    group = parser.add_argument_group("measuring")
    group.add_argument("--candidates", type=int, default=3, help="predicted-best layouts to measure (default: 3)")
    group.add_argument("--first-steps", type=int, default=1,
                       help="timed steps per layout in round 1 at the least, doubled each round (default: 1)")
    group.add_argument("--min-seconds", type=float, default=0.3,
                       help="round 1 times at least this many predicted seconds of steps per layout, as single "
                            "short steps are noisy (default: 0.3)")
    group.add_argument("--warmup", type=int, default=1, help="untimed steps before each measurement (default: 1)")
    group.add_argument("--timeout", type=float, default=180.0, help="seconds per measurement (default: 180)")
    group.add_argument("--out", type=Path, default=None, help="also write the result as JSON to this file")
    return parser


def _cell(layout: Layout, preset: str) -> Cell:
    return Cell(pp=layout.pp, dp=layout.dp, batch_size=layout.batch, chunks=layout.chunks, schedule=layout.schedule,
                checkpoint=layout.checkpoint, preset=preset)


def _describe(cell: Cell) -> str:
    return f"dp={cell.dp} pp={cell.pp} {cell.schedule} chunks={cell.chunks} checkpoint={cell.checkpoint}"


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--profile", args.profile), ("--model", getattr(args, "model", None))):
        if value is not None:
            raise ConfigError(f"tune measures the reference Transformer presets; {flag} is for `plan` only",
                              hint="pass --preset NAME")
    for flag, given in (("--recompute-unit layer", getattr(args, "recompute_unit", "stage") != "stage"),
                        ("--gpu-node", getattr(args, "gpu_node", None) is not None),
                        ("--gpu", getattr(args, "gpu", None) is not None)):
        if given:
            raise ConfigError(f"tune measures its layouts on this machine as pipetrain runs them; {flag} is for "
                              "`plan` only", hint=f"drop {flag.split()[0]}")
    for name in ("candidates", "first_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", hint="pass 1 or more")
    if args.precision != "fp32":
        raise ConfigError(f"tune measures its layouts in fp32, not --precision {args.precision}",
                          hint="drop --precision (use `pipetrain plan --precision` to plan other precisions)")
    if not args.min_seconds >= 0:
        raise ConfigError(f"--min-seconds must be >= 0, got {args.min_seconds}", hint="pass e.g. --min-seconds 0.3")
    preset, device = args.preset or "cpu", device_choice(args)
    args.top = 4 * args.candidates  # some predicted-best layouts may be ones a bench cell does not run
    if (args.tp or 1) > 1:
        raise ConfigError(f"tune measures its layouts as bench cells, which run tp=1, not --tp {args.tp}",
                          hint="drop --tp (use `pipetrain plan --tp` to plan tensor-parallel layouts)")
    result, info = planned(args, dp_modes=("ddp",), balances=("uniform",), virtual=(2,), tps=(1,))
    chosen = [p for p in result.best if cell_problem(_cell(p.layout, preset)) is None][: args.candidates]
    cells = [_cell(p.layout, preset) for p in chosen]
    grid = [c for c in (_cell(lay, preset) for lay in enumerate_layouts(
        info["blocks"], info["gpus"], args.batch, info["space"], info["gpus_per_node"])) if cell_problem(c) is None]
    if not cells:
        raise ConfigError("none of the predicted-best layouts is one a bench cell can run",
                          hint="allow more layouts (e.g. --schedules gpipe,1f1b) or another --gpus")
    log.info("tune: %d layouts planned, measuring the predicted best %d", len(grid), len(cells))
    measured: dict[tuple[Cell, int], float | None] = {}

    def measure(cell: Cell, steps: int) -> float | None:
        outcome = run_cell(cell, warmup=args.warmup, steps=steps, timeout_s=args.timeout, device=device)
        step_s = outcome.median_step_s if outcome.ok else None
        measured[cell, steps] = step_s
        log.info("  %s: %d steps, %s", _describe(cell), steps,
                 f"{step_s:.4f} s/step" if step_s is not None else f"{outcome.status} ({outcome.reason})")
        return step_s

    first_steps = max([args.first_steps] + [math.ceil(args.min_seconds / p.step_s) for p in chosen])
    halving = successive_halving(cells, measure, first_steps=first_steps, warmup=args.warmup)
    best = cells[halving.best]
    last_steps = max(t.steps for t in halving.trials)
    naive = Cell(pp=best.pp, dp=best.dp, batch_size=best.batch_size, chunks=1, schedule="gpipe",
                 checkpoint="never", preset=preset)
    cost = halving.cell_steps
    naive_s = measured.get((naive, last_steps))
    if naive_s is None:
        naive_s = measure(naive, last_steps)
        cost += args.warmup + last_steps
    grid_cost = len(grid) * GRID_CELL_STEPS
    speedup = naive_s / halving.best_step_s if naive_s else None
    print(f"pipetrain tune: {info['gpus']} devices, global batch {args.batch}, preset {preset!r}")
    print(f"  measured best: {_describe(best)}: {halving.best_step_s:.4f} s/step "
          f"({args.batch / halving.best_step_s:.1f} samples/s)")
    if speedup is not None:
        print(f"  naive ({_describe(naive)}): {naive_s:.4f} s/step; speed-up {speedup:.2f}x")
    print(f"  search cost: {cost} cell-steps ({len(halving.trials)} measurements) against {grid_cost} for the full "
          f"grid of {len(grid)} layouts x {GRID_CELL_STEPS} steps: {100 * cost / grid_cost:.0f}%")
    print("  train it: pipetrain train " + " ".join([
        "--pp", str(best.pp), "--dp", str(best.dp), "--schedule", best.schedule, "--chunks", str(best.chunks),
        "--checkpoint", best.checkpoint, "--batch-size", str(best.batch_size), "--preset", preset]))
    if args.out is not None:
        args.out.write_text(json.dumps({
            "best": best.as_dict(), "best_step_s": halving.best_step_s, "naive": naive.as_dict(), "naive_step_s": naive_s,
            "speedup": speedup, "cell_steps": cost, "grid_cells": len(grid), "grid_cell_steps": grid_cost,
            "trials": [{"cell": cells[t.index].as_dict(), "steps": t.steps, "step_s": t.step_s} for t in halving.trials],
        }, indent=2) + "\n")
    return 0
