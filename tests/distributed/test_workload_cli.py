"""A model of its own from the command line: examples/my_model.py through `train` on 2 ranks.

Each rank is a fresh process that loads the file again (and unpickles the file's own dataset type). `check`
runs the same file on its ranks in tests/distributed/test_check.py (in the job of every check case, which
saves a spawn; the verb's flags and exit codes are tests/unit/test_check_report.py's). `bench`
reads the same spec (its cells' `preset` axis, tests/unit/test_bench_grid.py); a real bench run of the file is
in docs/check.md (a cell costs one more spawned job, ~25 s on the loaded CI machine).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipetrain.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = f"{ROOT / 'examples' / 'my_model.py'}:workload"


def test_train_a_file_workload_on_two_ranks(tmp_path, capfd):
    metrics = tmp_path / "metrics.json"
    code = main(["train", "--workload", EXAMPLE, "--preset", "tiny", "--pp", "2", "--chunks", "2", "--batch-size", "16",
                 "--train-samples", "64", "--test-samples", "32", "--epochs", "1", "--no-progress", "--lr", "0.01",
                 "--metrics", str(metrics), "--run-dir", str(tmp_path / "run")])
    out = capfd.readouterr().out
    assert code == 0, out
    (report,) = json.loads(metrics.read_text())
    assert report["steps"] == 4 and report["synthetic"] and 0 < report["train_loss"] < 5
    assert "workload spiral, preset tiny" in out
