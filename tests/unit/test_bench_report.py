"""Tests of bench reports: CSV/JSON/markdown contents, heatmap PNGs, summary lines and the environment."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pipetrain.bench.grid import Cell, cell_problem, expand_grid
from pipetrain.bench.report import CSV_COLUMNS, collect_environment, summary_lines, write_reports
from pipetrain.bench.results import CellResult


def _results() -> list[CellResult]:
    out = []
    for cell in expand_grid({"pp": [1, 2], "schedule": ["gpipe", "1f1b"], "batch": [32, 64], "chunks": [1, 2, 4]}):
        problem = cell_problem(cell)
        if problem:
            out.append(CellResult.failed(cell, "invalid", problem))
        elif cell.pp == 2 and cell.batch_size == 64 and cell.chunks == 1:
            out.append(CellResult.failed(cell, "oom", "out of CPU memory"))
        elif cell.pp == 2 and cell.schedule == "1f1b" and cell.batch_size == 64 and cell.chunks == 4:
            out.append(CellResult.failed(cell, "timeout", "over 60 s"))
        else:
            step = cell.batch_size / 100 * (cell.chunks + cell.pp - 1) / cell.chunks
            out.append(CellResult.from_steps(cell, [step, step * 1.1], steps_per_epoch=10,
                                             peak_mem_mb_per_stage=[200.0 + cell.batch_size] * cell.pp))
    return out


ENV = {"device": "cpu", "device_name": "test CPU", "torch": "2.13", "data": "synthetic", "command": "pipetrain bench"}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One write of every report (figures take about a second each), shared by the tests below."""
    return write_reports(_results(), tmp_path_factory.mktemp("bench") / "out", environment=ENV)


def test_write_reports(written: list[Path]) -> None:
    results = _results()
    paths = written
    out = paths[0].parent
    names = {p.name for p in paths}
    assert {"results.csv", "results.json", "results.md"} <= names
    assert all(p.exists() for p in paths)

    with open(out / "results.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == len(results)
    by_key = {row["key"]: row for row in rows}
    naive = by_key[Cell(pp=2, batch_size=32, chunks=1).key]
    assert naive["status"] == "ok" and float(naive["peak_mem_mb"]) == 232.0
    assert naive["peak_mem_mb_per_stage"] == "232.0;232.0"
    four = by_key[Cell(pp=2, batch_size=32, chunks=4).key]
    assert float(four["speedup_vs_chunks1"]) == pytest.approx(2 / 1.25)
    assert by_key[Cell(pp=2, batch_size=64, chunks=1).key]["median_step_s"] == ""

    doc = json.loads((out / "results.json").read_text())
    assert doc["environment"] == ENV and len(doc["results"]) == len(results) and doc["summary"]

    md = (out / "results.md").read_text()
    assert "## pp=2, schedule=gpipe, checkpoint=never" in md
    assert "| batch \\ chunks | 1 | 2 | 4 |" in md
    table = md.split("## pp=2, schedule=gpipe, checkpoint=never")[1].split("##")[0]
    rows64 = [line for line in table.splitlines() if line.startswith("| 64 |")]
    assert len(rows64) == 1 and rows64[0].split("|")[2].strip() == "OOM"
    assert " s / 232 MB" in table
    assert "—" in md and "timeout" in md  # 1f1b needs chunks >= pp; one cell timed out
    assert "schedule=1f1b" in md and "pp=1, schedule=1f1b" not in md  # an all-invalid group is not drawn
    assert "6 cells of groups with no valid combination are not shown" in md


def test_heatmaps_are_images(written: list[Path]) -> None:
    import matplotlib.image

    pngs = [p for p in written if p.suffix == ".png"]
    assert [p.name for p in pngs] == ["heatmap_step_time.png", "heatmap_peak_memory.png", "heatmap_speedup.png"]
    for png in pngs:
        image = matplotlib.image.imread(png)
        height, width = image.shape[:2]
        assert 300 < height < 3000 and 500 < width < 4000
        assert image.std() > 0.05  # not a blank canvas


def test_summary_lines() -> None:
    lines = summary_lines(_results())
    assert "pp=2 schedule=gpipe batch=32: best chunks=4, 1.6x faster than naive (chunks=1)" in lines
    oom = next(line for line in lines if line.startswith("pp=2 schedule=gpipe batch=64"))
    assert "naive (chunks=1) ran out of memory; chunks=2 is the smallest that fits" in oom
    # 1f1b cannot run one chunk on 2 stages: compared with the gpipe chunks=1 cell (same computation)
    assert "pp=2 schedule=1f1b batch=32: best chunks=4, 1.6x faster than naive (chunks=1)" in lines
    oom_1f1b = next(line for line in lines if line.startswith("pp=2 schedule=1f1b batch=64"))
    assert "naive (chunks=1) ran out of memory" in oom_1f1b
    assert not any(line.startswith("pp=1 schedule=1f1b") for line in lines)
    one = [CellResult.failed(Cell(pp=2, batch_size=8, chunks=c), "oom", "x") for c in (1, 2)]
    one.append(CellResult.failed(Cell(pp=2, batch_size=8, chunks=16), "invalid", "chunks > batch"))
    assert summary_lines(one) == ["pp=2 batch=8: no cell finished (chunks=1 OOM, chunks=2 OOM, chunks=16 invalid)"]


def test_summary_when_naive_wins() -> None:
    results = [CellResult.from_steps(Cell(pp=1, batch_size=8, chunks=c), [c * 1.0], steps_per_epoch=1,
                                     peak_mem_mb_per_stage=[1.0]) for c in (1, 2)]
    assert summary_lines(results) == ["pp=1 batch=8: best chunks=1 (naive, 1 s/step); micro-batching did not help"]


def test_collect_environment() -> None:
    env = collect_environment(["pipetrain", "bench", "--grid", "batch=32 64"], device="cpu")
    assert env["device"] == "cpu" and env["torch"] and env["cpu_count"] >= 1
    assert env["command"] == "pipetrain bench --grid 'batch=32 64'"
    assert env["git_revision"] and env["date"]
    json.dumps(env)
