"""`pipetrain bench`: the Pipe benchmark (stages × batch size × chunks), time and memory per cell, OOM cells."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pipetrain.bench.grid import GridSpec, default_axes
from pipetrain.bench.report import collect_environment, summary_lines, write_reports
from pipetrain.bench.results import ResultStore, compute_speedups
from pipetrain.bench.runner import run_grid
from pipetrain.cli.device_args import add_device_argument, device_choice
from pipetrain.errors import ConfigError
from pipetrain.logs.config import probe_write
from pipetrain.trace.files import check_trace_dir

__all__ = ["add_parser", "run"]

log = logging.getLogger("pipetrain")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("bench", help=__doc__, description=__doc__)
    parser.add_argument("--grid", action="append", default=[], metavar="AXIS=V1,V2",
                        help="replace an axis of the default grid, e.g. batch=32,64 chunks=1,4 pp=2 "
                             "schedule=gpipe,1f1b checkpoint=never,except_last mem=2048 (repeatable)")
    parser.add_argument("--quick", action="store_true",
                        help="a small grid (pp 1,2 x batch 32,128 x chunks 1,4, cpu preset; about 2 minutes on 2 idle CPU cores)")
    parser.add_argument("--mem-limit", type=int, default=None, metavar="MB",
                        help="emulate a device of this much memory per rank (cells beyond it are OOM)")
    parser.add_argument("--workload", default=None, metavar="NAME|MODULE:NAME|FILE.py:NAME",
                        help="the workload whose presets the preset axis names (default: the classifier; "
                             "preset=WORKLOAD:PRESET names one per value)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default: bench-out)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per cell (default: 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per cell (default: 5)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per cell (default: 180)")
    parser.add_argument("--fresh", action="store_true", help="measure every cell again instead of resuming")
    parser.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="also write each cell's traced steps (trace.json, gantt.png, summary) to DIR/<cell>; "
                             "the measured-bubble column is always computed from 2 steps traced after the timed ones")
    add_device_argument(parser)
    return parser


def _check_out(out: Path) -> None:
    probe_write(out / ".write-test", f"to the output folder {str(out)!r}", folder=out,
                hint="pass --out with a folder you can write to")


def _with_workload(grid: GridSpec, workload: str | None) -> GridSpec:
    """`grid` whose presets are `workload`'s (`WORKLOAD:PRESET`, the form a cell reads)."""
    if workload is None:
        return grid
    presets = grid.axes.get("preset", ["cpu"])
    named = [p for p in presets if ":" in p]
    if named:
        raise ConfigError(f"--workload {workload} and the preset axis value {named[0]!r} both name the workload",
                          hint="pass --workload with plain preset names (preset=tiny), or preset=WORKLOAD:PRESET alone")
    return GridSpec({**grid.axes, "preset": [f"{workload}:{p}" for p in presets]})


def run(args: argparse.Namespace) -> int:
    for name in ("warmup", "steps"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name} {getattr(args, name)} is too small", hint=f"pass --{name} 1 or more")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout:g} is not a positive number of seconds", hint="e.g. --timeout 180")
    device = device_choice(args)
    overrides = list(args.grid) + ([f"mem={args.mem_limit}"] if args.mem_limit is not None else [])
    grid = GridSpec(default_axes(device, args.quick)).with_overrides(overrides)
    cells = _with_workload(grid, args.workload).cells()
    _check_out(args.out)
    if args.trace is not None:
        check_trace_dir(args.trace)
    store = ResultStore(args.out / "cells.jsonl")
    if args.fresh and store.path.exists():
        store.path.unlink()
    environment = collect_environment(["pipetrain", *sys.argv[1:]], device=device)  # argv[0] may be __main__.py
    environment["data"] = "synthetic"
    log.info("pipetrain bench: %d cells on %s -> %s", len(cells), device, args.out)
    interrupted = False
    try:
        run_grid(cells, store, warmup=args.warmup, steps=args.steps, timeout_s=args.timeout,
                 progress=sys.stderr.isatty(), trace_dir=args.trace, device=device)
    except KeyboardInterrupt:
        interrupted = True
        log.info("interrupted: every finished cell is kept in %s; run the same command again to resume", store.path)
    keys = {cell.key for cell in cells}
    results = compute_speedups([r for k, r in store.load().items() if k in keys])
    paths = write_reports(results, args.out, environment=environment)
    for line in summary_lines(results):
        print(line)
    print("reports: " + ", ".join(str(p) for p in paths))
    return 130 if interrupted else 0
