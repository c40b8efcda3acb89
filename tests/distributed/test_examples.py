"""The README's quick-start example, and the Lightning example (with the `lightning` extra), run as written and learn
their toy task."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.lightning_runs import quiet_port, run_script

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_trains():
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 4, run.stdout  # printed once, by one rank
    assert losses[-1] < 0.3


def test_lightning_example_trains(tmp_path):
    pytest.importorskip("lightning")
    example = EXAMPLE.with_name("lightning_pipeline.py")
    code, output = run_script([sys.executable, str(example)], {**os.environ, "OMP_NUM_THREADS": "1",
                                                                "MASTER_PORT": str(quiet_port())},
                              tmp_path / "example.log", timeout_s=240)
    assert code == 0, output[-6000:]
    losses = [float(m) for m in re.findall(r"epoch \d: loss (\d+\.\d+)", output)]
    assert len(losses) == 4, output  # printed by rank 0 alone
    assert losses[-1] < 0.3
