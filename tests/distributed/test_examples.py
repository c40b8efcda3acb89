"""The README's quick-start example runs as written and learns its toy task."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_trains():
    run = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 4, run.stdout  # printed once, by one rank
    assert losses[-1] < 0.3
