"""The docs' bubble table: built by the simulator, equal to the closed forms it is checked against."""

from __future__ import annotations

import pytest

from benchmarks.bubble_table import main
from pipetrain.plan.bubbles import bubble_rows, markdown
from pipetrain.trace.summary import ideal_bubble


def test_rows_equal_the_closed_forms(capsys):
    rows = bubble_rows((2, 4), (2, 4))
    assert {(r.schedule, r.pp, r.chunks) for r in rows} == {
        (s, p, k * p) for s in ("1f1b", "zero-bubble", "zbv", "dualpipev") for p in (2, 4) for k in (2, 4)}
    for r in rows:
        if r.schedule != "zero-bubble":
            assert r.bubble == pytest.approx(ideal_bubble(r.schedule, r.pp, r.chunks, 2), abs=1e-12), r
        want_peak = {"1f1b": r.pp, "zero-bubble": r.pp, "zbv": r.pp, "dualpipev": r.pp + 0.5}[r.schedule]
        assert r.peak_activations == pytest.approx(want_peak), r
    table = markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| 4 | 8 | 1f1b | 27.3 % | 1.000 | 4 |" in table
    assert main(["--pp", "2", "--per-rank", "2"]) == 0
    assert "| 2 | 4 | zbv | 4.0 % | 0.833 | 2 |" in capsys.readouterr().out


def test_predicted_table_uses_the_calibration(tmp_path, capsys):
    from pipetrain.plan.hardware import DEFAULT_DEVICE, DEFAULT_NETWORK, Calibration, save_calibration

    save_calibration(Calibration(device=DEFAULT_DEVICE, network=DEFAULT_NETWORK, backend="nccl", measured="now"),
                     tmp_path / "c.json")
    assert main(["--calibration", str(tmp_path / "c.json"), "--pp", "2", "--per-rank", "2", "--batch", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[3].strip() for line in lines[2:]] == ["1f1b", "zero-bubble", "zbv", "dualpipev"]
    assert lines[2].split("|")[5].strip() == "1.00"
