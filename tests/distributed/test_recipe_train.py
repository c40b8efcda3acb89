"""The recipe in `pipetrain train`: the LR schedule resumes under another layout, divergence stops the job once.

Each job trains the tiny preset on its synthetic corpus (passed explicitly: no `--data`), batch 16, one epoch
(real processes, CPU/gloo). The LR of every step is seen by wrapping `Recipe.step` inside the ranks of a
Python-level job (`train_rank`); the divergence runs go through the command line.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipetrain.checkpoint.durable import DurableConfig
from pipetrain.checkpoint.folders import read_meta
from pipetrain.cli.main import main
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.recipe import Recipe, RecipeConfig, lr_at
from pipetrain.train.loop import TrainConfig, train_rank

RTOL = 1e-5
STEPS = 10  # 160 samples in batches of 16
RECIPE = RecipeConfig(lr=3e-3, lr_schedule="cosine", warmup_steps=2, min_lr=3e-4, grad_clip=1.0)
CONFIG = TrainConfig(preset="tiny", data="synthetic", train_samples=16 * STEPS, test_samples=16, batch_size=16, epochs=1,
                     progress=False, recipe=RECIPE,
                     parallel=ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2)))
DP2 = ParallelConfig(dp=2, pipeline=PipelineConfig(pp=1, schedule="gpipe", n_microbatches=2))
ARGS = ["--preset", "tiny", "--data", "synthetic", "--train-samples", "160", "--test-samples", "16", "--batch-size", "16", "--epochs", "1",
        "--no-progress", "--pp", "2", "--chunks", "2"]


def _recording(spec: RankSpec, config: TrainConfig, out: str) -> None:
    """Train with `Recipe.step` wrapped: rank 0 writes (step, lr, loss, grad norm) of every step to `out`."""
    steps = []
    original = Recipe.step

    def step(self: Recipe, index: int, result):
        outcome = original(self, index, result)
        steps.append((index, outcome.lr, result.loss, outcome.grad_norm))
        return outcome

    Recipe.step = step  # in this rank's process only
    train_rank(spec, config)
    if spec.rank == 0:
        Path(out).write_text(json.dumps(steps))


def _run(config: TrainConfig, out: Path) -> list[tuple[int, float, float, float]]:
    world = config.parallel.world_size
    spawn(_recording, ranks=range(world), world_size=world, master_addr="127.0.0.1", master_port=free_port(),
          args=(config, str(out)), timeout_s=300)
    return [tuple(row) for row in json.loads(out.read_text())]


def test_the_lr_schedule_resumes_under_another_layout(tmp_path):
    save_dir = tmp_path / "ckpt"
    reference = _run(replace(CONFIG, durable=DurableConfig(save_dir=save_dir, save_every=4)), tmp_path / "ref.json")
    assert [row[0] for row in reference] == list(range(STEPS))
    lrs = [row[1] for row in reference]
    assert lrs == [lr_at(RECIPE, step, STEPS) for step in range(STEPS)]
    assert lrs[:3] == pytest.approx([1.5e-3, 3e-3, 3e-3]) and lrs[-1] < lrs[5] < lrs[2]  # warm-up, then cosine
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(save_dir / "step-00000004", resumed_dir / "step-00000004")
    resumed = _run(replace(CONFIG, parallel=DP2, durable=DurableConfig(save_dir=resumed_dir, resume=True)),
                   tmp_path / "resumed.json")
    assert [row[0] for row in resumed] == list(range(4, STEPS))
    assert [row[1] for row in resumed] == lrs[4:]  # the same rate at every step, from the step counter alone
    for got, want in zip(resumed, reference[4:], strict=True):
        assert got[2] == pytest.approx(want[2], rel=RTOL) and got[3] == pytest.approx(want[3], rel=1e-4)


def _train(*extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipetrain", "train", *ARGS, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _one_error(job: subprocess.Popen, *expected: str) -> str:
    out, err = job.communicate(timeout=180)
    assert job.returncode == 2, err
    assert "Traceback" not in out + err, err
    errors = [line for line in err.splitlines() if line.startswith("pipetrain: error:")]
    assert len(errors) == 1, err
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def test_a_diverging_run_stops_before_its_update_with_one_message(tmp_path, capsys):
    # --lr 1e6: the first update leaves finite but huge weights, the second step's loss is nan
    stops, skips = tmp_path / "stops", tmp_path / "skips"
    jobs = [_train("--lr", "1e6", "--save-dir", str(stops), "--save-every", "1"),
            _train("--lr", "1e6", "--save-dir", str(skips), "--save-every", "1", "--skip-nonfinite", "2")]
    _one_error(jobs[0], "training diverged at step 2 (loss nan", "stopped before its optimizer step",
               f"the last complete checkpoint is '{stops}/step-00000001'", "hint: then resume with --resume")
    assert sorted(p.name for p in stops.iterdir()) == ["step-00000001"]
    assert main(["export", str(stops), str(tmp_path / "model.pt")]) == 0  # the previous checkpoint loads
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state and all(bool(torch.isfinite(t).all()) for t in state.values())

    _one_error(jobs[1], "training diverged at step 4", "2 such step(s) skipped before (--skip-nonfinite 2)",
               f"'{skips}/step-00000003'")
    position = read_meta(skips / "step-00000003").extras["position"]
    assert position["step"] == 3 and position["recipe"] == {"skipped": 2, "total_steps": STEPS}
    assert math.isfinite(position["totals"]["loss"])  # skipped steps stay out of the epoch's loss
    # the count is restored on resume: the next non-finite step is the third, and stops the job
    again = _train("--lr", "1e6", "--save-dir", str(skips), "--resume", "--skip-nonfinite", "2")
    _one_error(again, "training diverged at step 4", "2 such step(s) skipped before")


def test_under_torchrun_the_divergence_is_said_once(tmp_path):
    """Every rank stops (the values are global), rank 0 alone says it; before, each rank would print it."""
    from tests.distributed.test_launch import environ, run_together, torchrun

    argv = torchrun("--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    "-m", "pipetrain", "train", *ARGS, "--lr", "1e6")
    [(code, output)] = run_together([(argv, environ())], tmp_path, timeout_s=180)
    assert code != 0, output
    assert output.count("pipetrain: error:") == 1, output
    assert "training diverged at step 2 (loss nan" in output, output
