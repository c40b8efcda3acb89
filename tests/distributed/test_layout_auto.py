"""An `--layout auto` run's chosen configuration, given as explicit flags, trains to the same losses (bit for bit).

Both jobs (the tiny preset, 2 gloo ranks, 4 steps) run side by side; the choice comes from fixture files (a
profile fitted over micro-batch sizes 1-8 and this machine's calibration), so neither job measures anything. The
flags the explicit job gets are computed here from the same files, and the auto job must say it chose exactly
them, then print its prediction and, after the first steps, the measured figures beside it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.distributed.train_jobs import finish, start_train

from pipetrain.logs.jsonl import read_records
from pipetrain.partition.profile import load_profile
from pipetrain.plan.auto import Fixed, choose_layout, layout_flags
from pipetrain.plan.hardware import load_calibration
from pipetrain.plan.model import profile_blocks

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
PROFILE, CALIBRATION = FIXTURES / "tiny-profile.json", FIXTURES / "cpu-calibration.json"
ARGS = ["--preset", "tiny", "--data", "synthetic", "--train-samples", "64", "--test-samples", "16", "--batch-size",
        "16", "--max-steps", "4", "--no-progress", "--eval-every", "100"]


def _start(*extra: str) -> subprocess.Popen:
    return start_train(*ARGS, *extra, merge_stderr=True)


def _finish(job: subprocess.Popen) -> str:
    return finish(job, timeout=300)


def test_auto_choice_reproduced_by_explicit_flags_gives_the_same_losses(tmp_path):
    calib = load_calibration(CALIBRATION)
    blocks = profile_blocks(load_profile(PROFILE))
    expected = choose_layout(blocks, world=2, batch=16, device=calib.device, network=calib.network,
                             fixed=Fixed(pp=2)).prediction
    flags = layout_flags(expected)
    auto = _start("--layout", "auto", "--pp", "2", "--profile", str(PROFILE), "--calibration", str(CALIBRATION),
                  "--run-dir", str(tmp_path / "auto"))
    explicit = _start(*flags, "--run-dir", str(tmp_path / "explicit"))
    out_auto, out_explicit = _finish(auto), _finish(explicit)
    assert f"--layout auto chose {' '.join(flags)} for 2 ranks" in out_auto
    assert f"predicted {expected.step_s:.3f} s/step" in out_auto
    assert "--layout auto: predicted" in out_auto and "measured" in out_auto.split("--layout auto: predicted")[1]
    assert "--layout auto" not in out_explicit
    losses = [[r["loss"] for r in read_records(tmp_path / name / "steps.jsonl", "step")] for name in ("auto", "explicit")]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    recorded = (tmp_path / "auto" / "config.toml").read_text()  # read back by --config, it runs the same layout
    assert 'layout = "manual"' in recorded and "pp = 2" in recorded
