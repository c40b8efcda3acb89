"""The bench on real rank processes: an OOM cell does not stop the sweep, Ctrl-C keeps the finished cells
and a rerun resumes, the CLI writes every report, an empty grid or a bad timeout is one error line.

Cells use the tiny preset with one or two timed steps: every cell costs a fresh rank process (import of
torch and pipetrain, a few seconds of CPU), so the grids here are as small as the behaviour allows.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from matplotlib.image import imread

from pipetrain.bench.grid import Cell
from pipetrain.bench.results import ResultStore
from pipetrain.bench.runner import run_grid
from pipetrain.cli import bench as bench_cli
from pipetrain.cli.main import main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU memory limit is Linux only")

#: per batch row a number, an invalid "—" and an OOM cell; 4 single-rank processes, the OOM ones first (1 MB
#: is too little even for the process group's threads: the other way a cell runs out of memory)
SWEEP = ["--quick", "--steps", "2", "--warmup", "1", "--grid", "preset=tiny", "--grid", "pp=1",
         "--grid", "batch=32,64", "--grid", "chunks=1,2", "--grid", "mem=1,none"]
_TABLE_CELL = re.compile(r"^(OOM|—|[\d.e+-]+ s / \d+ MB)$")


def _default_sigint() -> None:
    # a background job of a non-interactive shell starts with SIGINT ignored, and a child inherits that (Python
    # then keeps ignoring it): reset it before exec, so the child's Python turns SIGINT into KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "pipetrain", "bench", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_oom_cell_is_captured_and_the_next_cell_still_runs(tmp_path: Path) -> None:
    # batch 4096 of the tiny model needs about 1 GB of activations: its first forward cannot fit in 200 MB
    cells = [Cell(pp=1, batch_size=4096, preset="tiny", mem_limit_mb=200), Cell(pp=1, batch_size=32, preset="tiny")]
    store = ResultStore(tmp_path / "cells.jsonl")
    results = run_grid(cells, store, warmup=1, steps=1, timeout_s=120, progress=False)
    oom, ok = results[cells[0].key], results[cells[1].key]
    assert oom.status == "oom", oom.reason
    assert (oom.reason or "").startswith("out of CPU memory: the bench memory limit (RLIMIT_DATA = ")
    assert "DefaultCPUAllocator: can't allocate memory" in (oom.reason or "") and "\n" not in (oom.reason or "")
    assert ok.status == "ok", ok.reason
    assert ok.median_step_s and ok.median_step_s > 0 and ok.peak_mem_mb and ok.peak_mem_mb > 0


@dataclass
class Phase:
    """One CLI run: exit code, output, and the cells.jsonl lines right after it."""

    code: int
    stdout: str
    stderr: str
    lines: list[str]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Phase, Phase]:
    """The small sweep interrupted by SIGINT once a cell is saved, then the same command again (it resumes).

    Sharing one folder between the interrupt and the end-to-end tests saves two process start-ups per cell.
    """
    out = tmp_path_factory.mktemp("sweep") / "bench"
    jsonl = out / "cells.jsonl"
    proc = _cli([*SWEEP, "--out", str(out)])
    deadline = time.monotonic() + 180
    while not _lines(jsonl) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    interrupted = Phase(proc.returncode, stdout, stderr, _lines(jsonl))
    rerun = _cli([*SWEEP, "--out", str(out)])
    stdout, stderr = rerun.communicate(timeout=240)
    return out, interrupted, Phase(rerun.returncode, stdout, stderr, _lines(jsonl))


def test_ctrl_c_keeps_finished_cells_and_a_rerun_resumes(sweep: tuple[Path, Phase, Phase]) -> None:
    out, interrupted, rerun = sweep
    assert interrupted.code == 130, interrupted.stderr
    assert "Traceback" not in interrupted.stderr and "run the same command again to resume" in interrupted.stderr
    kept = [json.loads(line) for line in interrupted.lines]
    assert 1 <= len(kept) < 8 and kept[0]["status"] == "oom"  # first cell: batch 32 under the 1 MB limit
    assert "reports: " in interrupted.stdout and f"{out}/results.md" in interrupted.stdout
    assert rerun.code == 0, rerun.stderr
    assert f"resuming: {len(kept)} of 8 cells already measured" in rerun.stderr
    assert rerun.lines[: len(kept)] == interrupted.lines  # finished cells are not measured again
    assert len(rerun.lines) == 8 and len({json.dumps(json.loads(x)["cell"]) for x in rerun.lines}) == 8


def test_cli_sweep_writes_csv_markdown_heatmaps_and_summary(sweep: tuple[Path, Phase, Phase]) -> None:
    out, _, rerun = sweep
    assert rerun.code == 0, rerun.stderr
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    status = {(r["mem_limit_mb"], r["batch_size"], r["chunks"]): r["status"] for r in rows}
    assert status == {(m, b, c): ("invalid" if c == "2" else "oom" if m == "1" else "ok")
                      for m in ("", "1") for b in ("32", "64") for c in ("1", "2")}
    assert all(float(r["median_step_s"]) > 0 and float(r["peak_mem_mb"]) > 0 for r in rows if r["status"] == "ok")
    assert all("bench memory limit (RLIMIT_DATA" in r["reason"] for r in rows if r["status"] == "oom")

    markdown = (out / "results.md").read_text()
    assert "## mem=None, pp=1, schedule=gpipe" in markdown and "## mem=1, pp=1, schedule=gpipe" in markdown
    assert "Memory limit 1 MB per rank: allocated memory (RLIMIT_DATA)" in markdown
    table_rows = [line for line in markdown.splitlines() if re.match(r"^\| (32|64) \|", line)]
    assert len(table_rows) == 4  # one row per batch in each of the two tables
    texts = [t.strip() for line in table_rows for t in line.strip("|").split("|")[1:]]
    assert len(texts) == 8 and all(_TABLE_CELL.match(t) for t in texts), texts
    assert texts.count("OOM") == 2 and texts.count("—") == 4

    for metric in ("step_time", "peak_memory", "speedup"):
        image = imread(out / f"heatmap_{metric}.png")
        assert image.ndim == 3 and image.shape[2] in (3, 4) and min(image.shape[:2]) > 200
    baseline = r"^mem=None pp=1 batch=32: [\d.]+ s/step at chunks=1, the only valid chunk count here$"
    assert re.search(baseline, rerun.stdout, re.M), rerun.stdout
    assert re.search(r"^mem=1 pp=1 batch=64: no cell finished \(chunks=1 OOM", rerun.stdout, re.M), rerun.stdout
    assert "reports: " in rerun.stdout


# Unknown axes, bad values, an unwritable --out and --steps 0 are cases of tests/unit/test_cli_errors.py.
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--grid", "batch="], "bench axis 'batch' has no values, so the grid is empty"),
        (["--grid", "chunks=,"], "bench axis 'chunks' has no values, so the grid is empty"),
        (["--timeout", "0"], "--timeout 0 is not a positive number of seconds"),
    ],
)
def test_bad_input_is_one_error_line(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_ranks(*_: object, **__: object) -> None:
        raise AssertionError("the CLI started the sweep instead of rejecting its input")

    monkeypatch.setattr(bench_cli, "run_grid", no_ranks)
    code = main(["bench", "--quick", "--out", str(tmp_path / "out"), *args])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipetrain: error: ") and needle in lines[0], captured.err
    assert "hint:" in lines[0] and captured.out == ""
