"""The grid runner: each cell in fresh processes, with a timeout, out-of-memory capture and resume."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from pipetrain.bench.cell import measure_rank
from pipetrain.bench.grid import Cell, cell_problem
from pipetrain.bench.results import CellResult, ResultStore
from pipetrain.errors import RankFailedError, RankTimeoutError
from pipetrain.launch.env import free_port
from pipetrain.launch.device import gpu_count, resolve_device
from pipetrain.launch.spawn import spawn
from pipetrain.workloads.classifier.imdb import num_batches

__all__ = ["run_cell", "run_grid", "trace_folder"]

log = logging.getLogger("pipetrain")

#: training-set size used for the time-per-epoch column (IMDB's 25,000 training reviews)
EPOCH_SAMPLES = 25_000


def run_cell(cell: Cell, *, warmup: int, steps: int, timeout_s: float, trace_dir: Path | None = None,
             device: str | None = None) -> CellResult:
    """Measure one cell in fresh rank processes; failures become "oom", "error" or "timeout" results.

    With `trace_dir`, the traced steps' files go to `trace_dir/<cell folder>` (see `trace_folder`). `device`:
    "cpu" or "cuda" (default: as `resolve_device`); on CUDA a cell of more ranks than GPUs is "invalid". A cell
    with a memory limit runs in fresh interpreters: under the CPU limit a rank forked from the fork server can die
    in glibc ("cannot allocate memory for thread-local data: ABORT", exit 127) instead of failing an allocation."""
    device = resolve_device(device)
    problem = cell_problem(cell, max_ranks=gpu_count() if device == "cuda" else None)
    if problem:
        return CellResult.failed(cell, "invalid", problem)
    work = Path(tempfile.mkdtemp(prefix="pipetrain-cell-"))
    try:
        spawn(measure_rank, ranks=range(cell.world_size), world_size=cell.world_size, master_addr="127.0.0.1",
              master_port=free_port(), args=(cell, warmup, steps, str(work), None if trace_dir is None else str(trace_folder(trace_dir, cell))),
              timeout_s=timeout_s, device=device, start_method=None if cell.mem_limit_mb is None else "spawn")
        measured = json.loads((work / "result.json").read_text())
        return CellResult.from_steps(
            cell,
            measured["step_times_s"],
            steps_per_epoch=num_batches(EPOCH_SAMPLES, cell.batch_size),
            peak_mem_mb_per_stage=measured["peak_mem_mb_per_stage"],
            measured_bubble=measured.get("measured_bubble"),
            peak_reserved_mb_per_stage=measured.get("peak_reserved_mb_per_stage"),
        )
    except RankTimeoutError:
        return CellResult.failed(cell, "timeout", f"not finished after {timeout_s:g} s")
    except RankFailedError as err:
        reports = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
        oom = [r for r in reports if r["status"] == "oom"]
        first = (oom or reports or [{"status": "error", "reason": err.message.splitlines()[-1]}])[0]
        return CellResult.failed(cell, first["status"], first["reason"])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def trace_folder(trace_dir: Path, cell: Cell) -> Path:
    """The folder of one cell's trace files, named after its key (e.g. `pp=2,batch=64,chunks=4`)."""
    return Path(trace_dir) / cell.key.replace("=", "-").replace(",", "_")


def run_grid(
    cells: Sequence[Cell], store: ResultStore, *, warmup: int, steps: int, timeout_s: float, progress: bool = True,
    trace_dir: Path | None = None, device: str | None = None,
) -> dict[str, CellResult]:
    """Measure every cell not already in `store`, appending each result as soon as it is known.

    An interrupt (Ctrl-C) stops the sweep between or inside cells; every finished cell is already saved.
    Without a progress bar (`progress` False, e.g. output not a terminal), each finished cell is logged.
    """
    done = store.done_keys()
    todo = [cell for cell in cells if cell.key not in done]
    if len(todo) < len(cells):
        log.info("resuming: %d of %d cells already measured in %s", len(cells) - len(todo), len(cells), store.path)
    bar = tqdm(total=len(todo), unit="cell", disable=not progress, dynamic_ncols=True)
    try:
        for index, cell in enumerate(todo, 1):
            bar.set_description(f"pp={cell.pp} batch={cell.batch_size} chunks={cell.chunks}")
            result = run_cell(cell, warmup=warmup, steps=steps, timeout_s=timeout_s, trace_dir=trace_dir, device=device)
            store.append(result)
            bar.update()
            if not progress:
                level = logging.DEBUG if result.status == "invalid" else logging.INFO
                log.log(level, "cell %d/%d %s: %s", index, len(todo), cell.key, _outcome(result))
    finally:
        bar.close()
    return store.load()


def _outcome(result: CellResult) -> str:
    if result.ok:
        bubble = "" if result.measured_bubble is None or result.cell.pp == 1 else (
            f", bubble {100 * result.measured_bubble:.0f}% (ideal {100 * (result.ideal_bubble or 0):.0f}%)")
        return f"{result.median_step_s:.3g} s/step, peak {result.peak_mem_mb:.0f} MB{bubble}"
    return f"{result.status} ({result.reason})"
