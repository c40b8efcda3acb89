"""`pipetrain train` on 2 gloo ranks writes the logs people read: one `steps.jsonl` record per step (1..N),
evaluations at the steps `--eval-every` and the epoch ends put them, TensorBoard scalars equal to those records,
a console line every `--log-every` steps, the run's best held-out result, and the effective configuration (from a
`--config` file under the flags) beside the logs and in the checkpoint.

Two real jobs of the tiny preset (6 steps per epoch, synthetic data) run side by side: A trains 8 steps with no
mid-epoch evaluation (so it evaluates at the end of epoch 1, step 6, and at the end of its run, step 8); B trains
12 steps with `--eval-every 4` from a config file. B's evaluation at step 8, in the middle of an epoch, equals A's
end-of-run evaluation at step 8 exactly, and B's training losses equal A's: evaluating does not disturb training.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from pathlib import Path

from tests.distributed.train_jobs import finish, start_train

from pipetrain.checkpoint import latest_checkpoint
from pipetrain.checkpoint.folders import read_meta
from pipetrain.logs.jsonl import read_records

ARGS = ["--preset", "tiny", "--data", "synthetic", "--train-samples", "96", "--test-samples", "32", "--batch-size", "16", "--epochs", "2",
        "--no-progress"]
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _start(*extra: str) -> subprocess.Popen:
    return start_train(*ARGS, *extra)


def _finish(job: subprocess.Popen) -> str:
    return finish(job, timeout=240)


def test_steps_evaluations_tensorboard_config_and_best(tmp_path):
    config = tmp_path / "b.toml"
    config.write_text(f"""
[logs]
eval-every = 4
run-dir = "{tmp_path / 'b'}"
log-every = 3          # the command line's --log-every 5 wins
{f'tensorboard = "{tmp_path / "tb"}"' if TENSORBOARD else ''}
""")
    a = _start("--max-steps", "8", "--run-dir", str(tmp_path / "a"), "--metrics", str(tmp_path / "a.json"))
    b = _start("--config", str(config), "--log-every", "5", "--save-dir", str(tmp_path / "ckpt"),
               "--metrics", str(tmp_path / "b.json"))
    out_a, out_b = _finish(a), _finish(b)

    steps_b = read_records(tmp_path / "b" / "steps.jsonl", "step")
    assert [r["step"] for r in steps_b] == list(range(1, 13))
    assert [r["epoch"] for r in steps_b] == [1] * 6 + [2] * 6
    assert all(math.isfinite(r["loss"]) and r["samples"] == 16 and r["lr"] == 1e-3 and r["step_time_s"] > 0
               and r["peak_mem_mb"] > 0 and r["mfu"] is None and r["skipped"] is False for r in steps_b)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in steps_b)  # the recipe's global norm
    evals_b = read_records(tmp_path / "b" / "steps.jsonl", "eval")
    assert [(r["step"], r["trigger"]) for r in evals_b] == [(4, "every"), (6, "epoch"), (8, "every"), (12, "epoch")]
    assert all(r["batches"] == 2 for r in evals_b)

    steps_a = read_records(tmp_path / "a" / "steps.jsonl", "step")
    evals_a = read_records(tmp_path / "a" / "steps.jsonl", "eval")
    assert [r["step"] for r in steps_a] == list(range(1, 9))
    assert [(r["step"], r["trigger"]) for r in evals_a] == [(6, "epoch"), (8, "epoch")]
    assert [r["loss"] for r in steps_a] == [r["loss"] for r in steps_b[:8]]  # evaluations left training alone
    mid, end = evals_b[2], evals_a[1]  # step 8: mid-epoch in B, the end of A's run
    assert (mid["loss"], mid["accuracy"]) == (end["loss"], end["accuracy"])
    assert (evals_b[1]["loss"], evals_b[1]["accuracy"]) == (evals_a[0]["loss"], evals_a[0]["accuracy"])

    reports = json.loads((tmp_path / "b.json").read_text())
    assert [r["test_loss"] for r in reports] == [evals_b[1]["loss"], evals_b[3]["loss"]]
    best = min(evals_b, key=lambda r: r["loss"])
    assert {k: reports[-1]["best_eval"][k] for k in ("step", "loss")} == {"step": best["step"], "loss": best["loss"]}
    assert f"best held-out loss {best['loss']:.4f}" in out_b and f"at step {best['step']}," in out_b
    shown = [line.split(" |")[0] for line in out_b.splitlines() if line.startswith("step ")]
    assert shown == ["step 5/12", "step 10/12", "step 12/12"]
    assert [line.split(" |")[0] for line in out_a.splitlines() if line.startswith("step ")] == ["step 8/8"]  # the last step

    written = (tmp_path / "b" / "config.toml").read_text()
    assert "eval-every = 4" in written and "log-every = 5" in written and "max-steps" not in written
    meta = read_meta(latest_checkpoint(tmp_path / "ckpt"))
    assert meta.config["logs"]["config_text"] == written  # the checkpoint says what run produced it

    if TENSORBOARD:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert {"train/loss", "train/accuracy", "train/lr", "train/grad_norm", "train/samples_per_s",
                "train/step_time_s", "train/peak_mem_mb", "eval/loss", "eval/accuracy"} <= set(events.Tags()["scalars"])
        for tag, field, records in (("train/loss", "loss", steps_b), ("train/accuracy", "accuracy", steps_b),
                                    ("train/grad_norm", "grad_norm", steps_b),
                                    ("eval/loss", "loss", evals_b)):
            scalars = events.Scalars(tag)
            assert [e.step for e in scalars] == [r["step"] for r in records]
            assert all(math.isclose(e.value, r[field], rel_tol=1e-6) for e, r in zip(scalars, records))  # float32
