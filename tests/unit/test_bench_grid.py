"""Tests of the bench grid: axis parsing, expansion order, cell keys and validity rules."""

from __future__ import annotations

import pytest

from pipetrain.bench.grid import Cell, GridSpec, cell_problem, default_axes, expand_grid, parse_axis
from pipetrain.errors import ConfigError


def test_parse_axis_reads_ints_and_names() -> None:
    assert parse_axis("batch=32,64,128") == ("batch", [32, 64, 128])
    assert parse_axis("chunks=1,2,4,8,16") == ("chunks", [1, 2, 4, 8, 16])
    assert parse_axis(" pp = 1, 2 ") == ("pp", [1, 2])
    assert parse_axis("schedule=gpipe,1f1b") == ("schedule", ["gpipe", "1f1b"])
    assert parse_axis("batch_size=8") == ("batch", [8])
    assert parse_axis("mem=none,512") == ("mem", [None, 512])
    assert parse_axis("chunks=4,1,4") == ("chunks", [4, 1])  # duplicates dropped, order kept


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("batchsize=32", "valid axes: preset, mem, pp, dp, tp, schedule, checkpoint, batch, chunks"),
        ("chunks=0", "positive integer"),
        ("chunks=two", "positive integer"),
        ("schedule=pipedream", "gpipe, 1f1b"),
        ("checkpoint=sometimes", "never, except_last, always"),
        ("batch", "NAME=V1,V2"),
        ("batch=", "no values"),
        ("preset=a b", "preset"),
    ],
)
def test_parse_axis_errors_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_axis(text)
    assert needle in str(info.value)
    assert info.value.hint


def test_expand_grid_order_and_defaults() -> None:
    cells = expand_grid({"chunks": [1, 4], "batch": [32, 64], "pp": [1, 2]})
    assert len(cells) == 8
    assert [(c.pp, c.batch_size, c.chunks) for c in cells[:4]] == [(1, 32, 1), (1, 32, 4), (1, 64, 1), (1, 64, 4)]
    assert cells[4].pp == 2
    first = cells[0]
    assert (first.dp, first.schedule, first.checkpoint, first.preset, first.mem_limit_mb) == (1, "gpipe", "never", "cpu", None)
    assert len({c.key for c in cells}) == 8


def test_expand_grid_schedule_outside_batch() -> None:
    cells = expand_grid({"batch": [8, 16], "schedule": ["gpipe", "1f1b"], "pp": [2]})
    assert [(c.schedule, c.batch_size) for c in cells] == [("gpipe", 8), ("gpipe", 16), ("1f1b", 8), ("1f1b", 16)]


def test_empty_grid_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no batch axis"):
        expand_grid({})
    with pytest.raises(ConfigError, match="no values"):
        expand_grid({"batch": [32], "chunks": []})
    with pytest.raises(ConfigError, match="unknown bench axis"):
        expand_grid({"batch": [32], "stages": [2]})


def test_cell_key_is_stable_and_round_trips() -> None:
    cell = Cell(pp=2, batch_size=64, chunks=4, mem_limit_mb=512)
    assert cell.key == "preset=cpu,mem=512,pp=2,dp=1,schedule=gpipe,checkpoint=never,batch=64,chunks=4"
    assert Cell.from_dict(cell.as_dict()) == cell
    assert Cell.from_dict({**cell.as_dict(), "future_field": 1}) == cell


def test_gridspec_overrides() -> None:
    spec = GridSpec(default_axes("cpu", quick=True)).with_overrides(["chunks=1,2", "pp=2"])
    cells = spec.cells()
    assert {c.chunks for c in cells} == {1, 2} and {c.pp for c in cells} == {2}
    assert {c.preset for c in cells} == {"cpu"}


@pytest.mark.parametrize(
    ("cell", "needle"),
    [
        (Cell(pp=2, batch_size=8, chunks=16), "larger than the batch size"),
        (Cell(pp=2, dp=2, batch_size=16, chunks=16), "larger than the batch size 8"),
        (Cell(pp=4, batch_size=32, chunks=2, schedule="1f1b"), "at least as many micro-batches"),
        (Cell(pp=2, dp=3, batch_size=32, chunks=1), "not divisible by dp=3"),
        (Cell(pp=2, batch_size=32, chunks=3, schedule="interleaved-1f1b"), "multiple of pp"),
        (Cell(pp=1, batch_size=32, chunks=2, schedule="1f1b"), "single-rank baseline"),
    ],
)
def test_cell_problem_rejects(cell: Cell, needle: str) -> None:
    problem = cell_problem(cell)
    assert problem is not None and needle in problem


def test_cell_problem_accepts_and_bounds_ranks() -> None:
    assert cell_problem(Cell(pp=2, batch_size=32, chunks=4, schedule="1f1b")) is None
    assert cell_problem(Cell(pp=1, batch_size=32, chunks=1)) is None
    assert "chunks=1" in (cell_problem(Cell(pp=1, batch_size=32, chunks=32)) or "")
    assert cell_problem(Cell(pp=2, dp=2, batch_size=32, chunks=4), max_ranks=4) is None
    assert "only 2 available" in (cell_problem(Cell(pp=4, batch_size=32, chunks=4), max_ranks=2) or "")


def test_default_axes() -> None:
    cpu = expand_grid(default_axes("cpu", quick=False))
    assert len(cpu) == 2 * 4 * 5 and {c.preset for c in cpu} == {"cpu"}
    quick = expand_grid(default_axes("cpu", quick=True))
    valid = [c for c in quick if cell_problem(c) is None]
    assert len(quick) == 8 and len(valid) == 6  # pp=1 is measured with chunks=1 only
    gpu = default_axes("cuda:0", quick=False)
    assert gpu["pp"] == [2, 4] and gpu["batch"] == [32, 64, 128, 256] and gpu["chunks"] == [1, 2, 4, 8, 16]
    with pytest.raises(ConfigError):
        default_axes("tpu", quick=False)


def test_bench_workload_flag_names_the_workload_of_every_preset():
    from pipetrain.cli.bench import _with_workload

    grid = GridSpec({"batch": [8], "preset": ["tiny", "cpu"]})
    spec = "examples/my_model.py:workload"
    assert [c.preset for c in _with_workload(grid, spec).cells()] == [f"{spec}:tiny", f"{spec}:cpu"]
    assert _with_workload(grid, None) is grid
    with pytest.raises(ConfigError, match="both name the workload"):
        _with_workload(GridSpec({"batch": [8], "preset": ["lm:tiny"]}), spec)
