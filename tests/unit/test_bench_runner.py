"""Tests of the bench runner without processes: resume, results saved as they come, failure classification.

`spawn` and `run_cell` are replaced in the runner module, so these tests check the runner's own logic; the
real cells (OOM capture, Ctrl-C, the CLI sweep) are in tests/distributed/test_bench_sweep.py.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

from pipetrain.bench import runner
from pipetrain.bench.grid import Cell
from pipetrain.launch.memory import is_oom_error, oom_reason
from pipetrain.bench.results import CellResult, ResultStore
from pipetrain.errors import RankFailedError, RankTimeoutError

CELLS = [Cell(pp=2, batch_size=32, chunks=c, preset="tiny") for c in (1, 2, 4)]


def _fake_result(cell: Cell) -> CellResult:
    return CellResult.from_steps(cell, [0.1 * cell.chunks], steps_per_epoch=10, peak_mem_mb_per_stage=[300.0, 290.0])


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Cell]:
    """Replace `run_cell` in the runner with a recorder that returns a made-up "ok" result."""
    seen: list[Cell] = []

    def fake_run_cell(cell: Cell, *, warmup: int, steps: int, timeout_s: float, trace_dir: Path | None = None,
                      device: str | None = None) -> CellResult:
        seen.append(cell)
        return _fake_result(cell)

    monkeypatch.setattr(runner, "run_cell", fake_run_cell)
    return seen


def test_run_grid_skips_cells_already_in_the_store(tmp_path: Path, calls: list[Cell]) -> None:
    store = ResultStore(tmp_path / "cells.jsonl")
    kept = CellResult.failed(CELLS[1], "oom", "out of CPU memory")  # a finished cell, whatever its status
    store.append(kept)
    results = runner.run_grid(CELLS, store, warmup=0, steps=1, timeout_s=10, progress=False)
    assert calls == [CELLS[0], CELLS[2]]
    assert results[CELLS[1].key] == kept
    assert set(results) == {c.key for c in CELLS}
    assert len(store.path.read_text().splitlines()) == 3  # nothing measured twice
    calls.clear()
    runner.run_grid(CELLS, store, warmup=0, steps=1, timeout_s=10, progress=False)
    assert calls == []  # a complete store: nothing left to run


def test_run_grid_saves_each_cell_before_an_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted_on_second(cell: Cell, **_: object) -> CellResult:
        if cell is CELLS[1]:
            raise KeyboardInterrupt
        return _fake_result(cell)

    monkeypatch.setattr(runner, "run_cell", interrupted_on_second)
    store = ResultStore(tmp_path / "cells.jsonl")
    with pytest.raises(KeyboardInterrupt):
        runner.run_grid(CELLS, store, warmup=0, steps=1, timeout_s=10, progress=False)
    assert list(store.load()) == [CELLS[0].key]


def test_run_grid_logs_each_cell_without_a_progress_bar(
    tmp_path: Path, calls: list[Cell], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="pipetrain"):
        runner.run_grid(CELLS[:2], ResultStore(tmp_path / "c.jsonl"), warmup=0, steps=1, timeout_s=10, progress=False)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("cell 1/2 preset=tiny") and "0.1 s/step, peak 300 MB" in lines[0]
    assert lines[1].startswith("cell 2/2")


def _fake_spawn(reports: dict[int, dict], error: Exception):
    """A `spawn` that writes the given rank reports into the cell's work folder, then raises `error`."""

    def spawn(fn, *, args, **_):
        work = Path(args[3])
        for rank, report in reports.items():
            (work / f"rank{rank}.json").write_text(json.dumps(report))
        raise error

    return spawn


def test_run_cell_prefers_the_oom_report(monkeypatch: pytest.MonkeyPatch) -> None:
    reports = {0: {"status": "error", "reason": "peer closed"}, 1: {"status": "oom", "reason": "out of CPU memory"}}
    monkeypatch.setattr(runner, "spawn", _fake_spawn(reports, RankFailedError("rank 0 failed")))
    result = runner.run_cell(CELLS[0], warmup=0, steps=1, timeout_s=10)
    assert (result.status, result.reason) == ("oom", "out of CPU memory")
    assert result.median_step_s is None and result.ideal_speedup is not None


def test_run_cell_without_reports_and_on_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    failed = RankFailedError("rank 1 failed:\nTraceback ...\nValueError: bad shape")
    monkeypatch.setattr(runner, "spawn", _fake_spawn({}, failed))
    result = runner.run_cell(CELLS[0], warmup=0, steps=1, timeout_s=10)
    assert (result.status, result.reason) == ("error", "ValueError: bad shape")
    monkeypatch.setattr(runner, "spawn", _fake_spawn({}, RankTimeoutError("still running")))
    result = runner.run_cell(CELLS[0], warmup=0, steps=1, timeout_s=7.5)
    assert (result.status, result.reason) == ("timeout", "not finished after 7.5 s")


def test_run_cell_invalid_cell_starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "spawn", _fake_spawn({}, AssertionError("spawn called")))
    result = runner.run_cell(Cell(pp=1, batch_size=32, chunks=4), warmup=0, steps=1, timeout_s=10)
    assert result.status == "invalid" and "single-rank baseline" in (result.reason or "")


def test_thread_start_failure_is_oom_only_under_a_cpu_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    exc = RuntimeError("Resource temporarily unavailable")  # what TCPStore raises when no thread stack fits
    unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    monkeypatch.setattr(resource, "getrlimit", lambda which: unlimited)
    assert not is_oom_error(exc)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (400 * 2**20, resource.RLIM_INFINITY))
    assert is_oom_error(exc) and is_oom_error(RuntimeError("can't start new thread"))
    reason = oom_reason(exc, "cpu")
    assert "RLIMIT_DATA = 400 MB" in reason and "thread's stack" in reason


def test_oom_reason_names_the_allocation_a_stage_wrapped() -> None:
    try:
        try:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 67108864 bytes.")
        except RuntimeError as inner:
            raise RuntimeError("[Stage 0] failed to run forward:\nstage summary") from inner
    except RuntimeError as exc:
        wrapped = exc
    assert is_oom_error(wrapped)
    reason = oom_reason(wrapped, "cpu")
    assert "\n" not in reason and "you tried to allocate 67108864 bytes" in reason
    assert reason.endswith("(in: [Stage 0] failed to run forward)")
