"""scripts/gpu-check.sh --dry-run: the GPU check's steps on the CPU at the tiny size (the tier skips itself), so the
script itself is tested where no GPU is (about 30 s on 2 loaded cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_writes_the_report(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env={"PYTHON": sys.executable,
                                                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "gpu-check-report.txt").read_text().splitlines()
    assert lines[0].startswith("# pipetrain gpu-check") and "device=cpu" in lines[0] and "dry_run=1" in lines[0]
    (tier,) = [line for line in lines if line.startswith("tier: ")]
    assert "skipped" in tier and "failed" not in tier and "error" not in tier, tier
    steps = [json.loads(line[len("step: "):]) for line in lines if line.startswith("step: ")]
    runs = [s for s in steps if "pipetrain_step_s" in s]
    assert [(r["precision"], r["checkpoint"]) for r in runs] == [("bf16", "never"), ("fp32", "never"),
                                                                  ("bf16", "always")]
    for run in runs:
        assert run["pipetrain_step_s"] > 0 and run["plain_step_s"] > 0 and run["overhead_ratio"] > 0
        assert run["predicted_step_s"] > 0 and run["mfu"] is None  # no MFU without a GPU's peak
    assert runs[0]["calibrated_layer_flops_per_s"] > 0
    assert any(s.get("profile_forward_backward_s", 0) > 0 for s in steps)
    assert lines[-1].startswith("seconds: ")


def test_unknown_argument_is_one_error():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--bogus"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "unknown argument '--bogus'" in done.stderr
