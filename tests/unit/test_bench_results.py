"""Tests of bench results: summaries, the append-only JSON-lines store, resume keys and speed-ups."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.bench.grid import Cell
from pipetrain.bench.results import CellResult, ResultStore, compute_speedups, ideal_speedup
from pipetrain.errors import ConfigError


def _ok(step: float, **cell: int | str) -> CellResult:
    return CellResult.from_steps(Cell(**cell), [step] * 3, steps_per_epoch=10, peak_mem_mb_per_stage=[100.0, 120.0])


def test_from_steps_summarizes() -> None:
    cell = Cell(pp=2, batch_size=32, chunks=4)
    r = CellResult.from_steps(cell, [0.4, 0.1, 0.2, 0.3, 9.0], steps_per_epoch=100, peak_mem_mb_per_stage=[5, 7])
    assert r.status == "ok" and r.median_step_s == pytest.approx(0.3)
    assert r.step_s_spread == pytest.approx(0.4 - 0.2)  # IQR: robust to the 9 s outlier
    assert r.samples_per_s == pytest.approx(32 / 0.3)
    assert r.epoch_s == pytest.approx(30.0)
    assert r.peak_mem_mb == 7.0
    assert r.ideal_speedup == pytest.approx(2 * 4 / (4 + 2 - 1))
    single = CellResult.from_steps(cell, [0.5], steps_per_epoch=1, peak_mem_mb_per_stage=[1])
    assert single.step_s_spread == 0.0
    with pytest.raises(ConfigError):
        CellResult.from_steps(cell, [], steps_per_epoch=1, peak_mem_mb_per_stage=[])


def test_ideal_speedup_formula() -> None:
    assert ideal_speedup(1, 8) == 1.0
    assert ideal_speedup(4, 1) == 1.0
    assert ideal_speedup(4, 16) == pytest.approx(64 / 19)
    assert ideal_speedup(4, 8, "interleaved-1f1b") == pytest.approx(32 / (8 + 1.5))
    assert ideal_speedup(4, 8, "zero-bubble") is None


def test_status_is_checked() -> None:
    with pytest.raises(ConfigError, match="unknown cell status"):
        CellResult(cell=Cell(batch_size=8), status="crashed")
    with pytest.raises(ConfigError):
        CellResult.failed(Cell(batch_size=8), "ok", "no")


def test_store_append_load_and_resume(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "sub" / "results.jsonl")
    assert store.load() == {} and store.done_keys() == set()
    a = _ok(0.5, pp=2, batch_size=32, chunks=1)
    b = CellResult.failed(Cell(pp=2, batch_size=32, chunks=2), "oom", "out of memory")
    c = CellResult.failed(Cell(pp=2, batch_size=32, chunks=4), "error", "boom")
    for r in (a, b, c):
        store.append(r)
    loaded = store.load()
    assert loaded == {a.key: a, b.key: b, c.key: c}
    assert store.done_keys() == {a.key, b.key, c.key}
    assert store.done_keys(retry={"error"}) == {a.key, b.key}
    again = _ok(0.4, pp=2, batch_size=32, chunks=4)  # a retried cell: the later line wins
    store.append(again)
    assert store.load()[again.key].median_step_s == 0.4


def test_store_tolerates_truncated_last_line(tmp_path: Path) -> None:
    store = ResultStore(tmp_path / "results.jsonl")
    a = _ok(0.5, pp=2, batch_size=32, chunks=1)
    store.append(a)
    with open(store.path, "a", encoding="utf-8") as fh:
        fh.write('{"v": 1, "cell": {"pp": 2, "batch_si')  # killed mid-write
    assert store.load() == {a.key: a}
    b = _ok(0.3, pp=2, batch_size=32, chunks=2)
    store.append(b)  # starts on a fresh line, so it is not glued to the broken one
    assert set(store.load()) == {a.key, b.key}


def test_compute_speedups() -> None:
    results = [
        _ok(1.0, pp=1, batch_size=32, chunks=1),
        _ok(1.2, pp=1, batch_size=32, chunks=4),
        _ok(2.0, pp=2, batch_size=32, chunks=1),
        _ok(1.0, pp=2, batch_size=32, chunks=4),
        _ok(0.8, pp=2, batch_size=32, chunks=4, schedule="1f1b"),
        CellResult.failed(Cell(pp=2, batch_size=64, chunks=1), "oom", "oom"),
        _ok(1.5, pp=2, batch_size=64, chunks=4),
    ]
    out = {r.key: r for r in compute_speedups(results)}
    get = lambda **kw: out[Cell(**kw).key]  # noqa: E731
    assert get(pp=2, batch_size=32, chunks=4).speedup_vs_chunks1 == pytest.approx(2.0)
    assert get(pp=2, batch_size=32, chunks=4).speedup_vs_pp1 == pytest.approx(1.0)
    assert get(pp=2, batch_size=32, chunks=1).speedup_vs_pp1 == pytest.approx(0.5)
    assert get(pp=1, batch_size=32, chunks=4).speedup_vs_chunks1 == pytest.approx(1 / 1.2)
    # 1f1b cannot run chunks=1 with pp=2: its naive reference is the gpipe chunks=1 cell
    assert get(pp=2, batch_size=32, chunks=4, schedule="1f1b").speedup_vs_chunks1 == pytest.approx(2.5)
    assert get(pp=2, batch_size=64, chunks=4).speedup_vs_chunks1 is None  # naive was OOM
    assert get(pp=2, batch_size=64, chunks=4).speedup_vs_pp1 is None
    assert get(pp=2, batch_size=64, chunks=1).speedup_vs_chunks1 is None
    assert [r.key for r in compute_speedups(results)] == [r.key for r in results]
