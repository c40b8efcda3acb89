"""The run log and its sinks without processes: the console line, steps.jsonl, TensorBoard, the best result,
when evaluation is due, and the flags' validation."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch

from pipetrain.errors import ConfigError
from pipetrain.logs.config import LogConfig, check_log_folders, default_run_dir
from pipetrain.logs.console import eval_line, step_line
from pipetrain.logs.jsonl import read_records
from pipetrain.logs.meter import StepMeter
from pipetrain.logs.records import EvalRecord, StepRecord
from pipetrain.logs.runlog import CONFIG_FILE, STEPS_FILE, RunLog
from pipetrain.pipeline.engine import StepResult


def _record(**changes) -> StepRecord:
    values = dict(step=120, epoch=2, loss=0.41234, accuracy=None, lr=9.1e-4, grad_norm=1.3249, samples=64,
                  step_time_s=0.1553, samples_per_s=412.2, peak_mem_mb=512.4)
    return StepRecord(**(values | changes))


def test_console_line_has_fixed_fields_in_order():
    assert step_line(_record(), 940) == ("step 120/940 | loss 0.4123 | lr 9.1e-04 | gnorm 1.32 | 412 samples/s | "
                                         "0.155 s/step | mem 512 MB")
    line = step_line(_record(grad_norm=None, accuracy=0.8125, tokens=2000, tokens_per_s=12880.4, mfu=0.4123))
    assert line == "step 120 | loss 0.4123 | acc 0.812 | lr 9.1e-04 | 12880 tokens/s | 0.155 s/step | mem 512 MB | mfu 41.2%"
    assert eval_line(EvalRecord(step=200, epoch=1, loss=0.50123, accuracy=0.771, batches=32, seconds=1.23)) == (
        "eval at step 200 | loss 0.5012 | acc 0.771 | 32 batches in 1.2 s")


def _result(loss: float) -> StepResult:
    return StepResult(loss=loss, accuracy=0.5, samples=8, count=8)


def _eval(step: int, loss: float) -> EvalRecord:
    return EvalRecord(step=step, epoch=1, loss=loss, accuracy=0.5, batches=2, seconds=0.1)


def test_run_log_writes_every_step_and_eval_and_keeps_the_best(tmp_path, caplog):
    config = LogConfig(run_dir=tmp_path / "run", log_every=2, eval_every=2, config_text="a = 1\n")
    meter = StepMeter(device=torch.device("cpu"), devices=1, per_token=False, precision="fp32")
    run = RunLog(config, meter, main=True, total_steps=5)
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        for step, loss in enumerate([0.9, 0.8, 0.7, 0.6, 0.5], start=1):
            run.begin_step()
            record = run.step(_result(loss), step=step, epoch=1, lr=1e-3, inputs=torch.zeros(8, 4, dtype=torch.long))
            assert record.samples_per_s > 0 and record.peak_mem_mb > 0 and record.mfu is None
            if run.due(step, epoch_end=step == 5):
                run.eval(_eval(step, {2: 0.7, 4: 0.65}[step]))
        run.eval(_eval(5, 0.68))
    run.close()
    assert (tmp_path / "run" / CONFIG_FILE).read_text() == "a = 1\n"
    steps = read_records(tmp_path / "run" / STEPS_FILE, "step")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and [r["loss"] for r in steps] == [0.9, 0.8, 0.7, 0.6, 0.5]
    assert [(r["step"], r["loss"]) for r in read_records(tmp_path / "run" / STEPS_FILE, "eval")] == [
        (2, 0.7), (4, 0.65), (5, 0.68)]
    assert (run.best.step, run.best.loss) == (4, 0.65)
    assert run.best_line() == "best held-out loss 0.6500 (acc 0.500) at step 4, epoch 1"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]  # every 2nd, and the last


def test_an_evaluation_without_a_loss_shows_its_reward_and_is_never_the_best():
    from pipetrain.logs.records import EpochReport, MetricTotals

    scored = EvalRecord(step=20, epoch=1, loss=None, batches=1, seconds=2.04, extras={"reward": 0.40625})
    assert eval_line(scored) == "eval at step 20 | reward 0.4062 | 1 batch in 2.0 s"
    meter = StepMeter(device=torch.device("cpu"), devices=1, per_token=False, precision="fp32")
    run = RunLog(LogConfig(run_dir=None, tensorboard=None), meter, main=False)
    run.eval(scored)
    assert run.best is None and run.best_line() is None
    report = EpochReport.of(1, 20, MetricTotals(0.5, 0.0, 4.0), MetricTotals(count=32.0), seconds=1.0,
                            synthetic=False, data="d", metrics=(), best=None, eval_split="held-out", held_out=scored)
    line = report.line(1)
    assert "held-out reward 0.4062" in line and "held-out loss" not in line and report.test_loss is None


def test_other_ranks_write_nothing_but_know_the_best(tmp_path):
    meter = StepMeter(device=torch.device("cpu"), devices=2, per_token=False, precision="fp32")
    run = RunLog(LogConfig(run_dir=tmp_path / "run", tensorboard=None), meter, main=False)
    assert run.step(_result(1.0), step=1, epoch=1, lr=1e-3) is None
    run.eval(_eval(1, 0.3))
    run.close()
    assert not (tmp_path / "run").exists() and run.best.loss == 0.3


def test_tokens_and_mfu_with_a_peak():
    from pipetrain.logs.mfu import ModelFlops

    flops = ModelFlops(params=100, layers=1, heads=1, head_dim=4)
    meter = StepMeter(device=torch.device("cpu"), devices=2, per_token=True, precision="fp32", flops=flops,
                      peak_tflops_=1e-9)
    meter.start()
    record = meter.record(StepResult(loss=2.0, accuracy=None, samples=3, count=40, perplexity=math.exp(2.0)),
                          step=1, epoch=1, lr=0.1, inputs=(torch.zeros(3, 16, dtype=torch.long), torch.ones(3, 16)))
    assert record.tokens == 40 and record.tokens_per_s == pytest.approx(40 / record.step_time_s)
    assert record.window_tokens == 3 * 16 and record.window_tokens_per_s == pytest.approx(48 / record.step_time_s)
    expected = (6 * 100 + 12 * 1 * 1 * 4 * 16) * 3 * 16 / record.step_time_s / (2 * 1e-9 * 1e12)
    assert record.mfu == pytest.approx(expected)


def test_answer_only_rows_show_the_tokens_processed_and_the_trained_ones_beside():
    """Instruction rows train their answers only: 4 rows of a 64-token window, 2 answer tokens each. The step line's
    throughput is the tokens the model processed (256 a step, what MFU counts), the trained ones (8) beside it."""
    meter = StepMeter(device=torch.device("cpu"), devices=2, per_token=True, precision="fp32")
    meter.start()
    ids = torch.zeros(4, 64, dtype=torch.long)
    record = meter.record(StepResult(loss=1.5, accuracy=0.5, samples=4, count=8), step=3, epoch=1, lr=1e-3,
                          inputs=(ids, torch.arange(64).expand(4, 64)))
    assert (record.tokens, record.window_tokens) == (8, 256)
    assert record.window_tokens_per_s / record.tokens_per_s == pytest.approx(32.0)
    line = step_line(replace(record, step_time_s=0.5, tokens_per_s=16.0, window_tokens_per_s=512.0, peak_mem_mb=None))
    assert line == "step 3 | loss 1.5000 | acc 0.500 | lr 1.0e-03 | 512 tokens/s (16 trained) | 0.500 s/step"
    every = step_line(replace(record, step_time_s=0.5, tokens_per_s=512.0, window_tokens_per_s=512.0, peak_mem_mb=None))
    assert "| 512 tokens/s |" in every  # every processed token trains: one figure
    slow = step_line(replace(record, step_time_s=50.0, tokens_per_s=0.16, window_tokens_per_s=20.5, peak_mem_mb=None))
    assert "| 20 tokens/s (0.16 trained) |" in slow


def test_eval_is_due_every_n_steps_but_not_twice_at_an_epoch_end():
    config = LogConfig(eval_every=3)
    assert [s for s in range(1, 13) if config.eval_due(s, epoch_end=s in (6, 12))] == [3, 9]
    bounded = LogConfig(eval_every=3, eval_batches=1)  # the end-of-epoch evaluation is bounded alike: it stands
    assert [s for s in range(1, 13) if bounded.eval_due(s, epoch_end=s in (6, 12))] == [3, 9]
    assert not any(LogConfig(eval_batches=2).eval_due(s, epoch_end=s == 6) for s in range(1, 10))
    assert not any(LogConfig().eval_due(s, epoch_end=False) for s in range(1, 10))


@pytest.mark.parametrize("changes, text", [
    ({"log_every": 0}, "--log-every must be 1 or more, got 0"),
    ({"eval_every": 0}, "--eval-every must be 1 or more, got 0"),
    ({"eval_every": 2, "eval_batches": 0}, "--eval-batches must be 1 or more, got 0"),
    ({"eval_batches": 0}, "--eval-batches must be 1 or more, got 0"),
    ({"peak_tflops": 0.0}, "--peak-tflops must be positive"),
])
def test_bad_log_config(changes, text):
    with pytest.raises(ConfigError, match=text.replace("(", r"\(")):
        LogConfig(**changes)


def test_log_folders_are_checked_without_being_created(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("")
    check_log_folders(LogConfig(run_dir=tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match="is not a folder"):
        check_log_folders(LogConfig(run_dir=afile))
    with pytest.raises(ConfigError, match="not a writable folder"):
        check_log_folders(LogConfig(run_dir=afile / "run"))


def test_default_run_dir():
    from datetime import datetime, timezone

    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    assert str(default_run_dir("lm", when, pid=42)) == "runs/lm-20260102-030405-p42"


def test_tensorboard_sink_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipetrain.logs.tensorboard import TensorBoardSink

    sink = TensorBoardSink(tmp_path)
    sink.step(_record(step=1, loss=0.5))
    sink.step(_record(step=2, loss=0.25))
    sink.eval(_eval(2, 0.75))
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/peak_mem_mb", "eval/loss",
            "eval/accuracy"} <= tags
    assert "train/accuracy" not in tags and "train/tokens_per_s" not in tags  # None fields are not written
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 0.75)]


def test_tensorboard_without_the_package_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'pipetrain\[tensorboard\]'"):
        LogConfig(tensorboard="tb")


def test_under_a_progress_bar_only_evaluations_are_logged(caplog):
    meter = StepMeter(device=torch.device("cpu"), devices=1, per_token=False, precision="fp32")
    run = RunLog(LogConfig(log_every=1), meter, main=True, total_steps=1, console=False)
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        run.begin_step()
        run.step(_result(0.5), step=1, epoch=1, lr=1e-3)
        run.eval(_eval(1, 0.4))
    run.close()
    assert [r.getMessage().split(" |")[0] for r in caplog.records] == ["eval at step 1"]


def test_eval_batches_bounds_the_batches_read():
    """`--eval-batches K` reads K batches of the held-out stream (the trainer's own `evaluate_split`, no processes)."""
    from types import SimpleNamespace

    from pipetrain.train import loop as trainer
    from pipetrain.checkpoint.durable import Position

    read: list[int] = []

    class Workload:
        metrics = ("accuracy",)

        def batches(self, dataset, batch_size, **kwargs):
            for i in range(5):
                read.append(i)
                yield torch.full((2, 3), i), torch.zeros(2, dtype=torch.long)

        def num_batches(self, dataset, batch_size, *, replicas):
            return 5

    engine = SimpleNamespace(evaluate=lambda x, y, rows: StepResult(loss=float(x[0, 0]), accuracy=1.0, samples=2, count=2))
    config = SimpleNamespace(batch_size=2, seed=0, bucket=False, parallel=SimpleNamespace(dp=1))
    durable = SimpleNamespace(progress=lambda: None, stop_requested=lambda: False)
    at = Position(step=7, epoch=2)
    _, record = trainer._held_out(engine, Workload(), None, config, 0, durable, at, "every", 2)
    assert read == [0, 1] and (record.batches, record.loss, record.step, record.epoch) == (2, 0.5, 7, 2)
    read.clear()
    _, record = trainer._held_out(engine, Workload(), None, config, 0, durable, at, "epoch")
    assert read == [0, 1, 2, 3, 4] and (record.batches, record.loss, record.trigger) == (5, 2.0, "epoch")
    read.clear()  # a stop signal after the second batch: the evaluation ends there, with no record
    asked = iter([False, True])
    stopping = SimpleNamespace(progress=lambda: None, stop_requested=lambda: next(asked))
    assert trainer._held_out(engine, Workload(), None, config, 0, stopping, at, "epoch") is None
    assert read == [0, 1]


def test_a_stop_signal_is_agreed_between_evaluation_batches_when_saving(tmp_path):
    """`DurableRun.stop_requested`: True once a stop signal came (SIGTERM, caught only with --save-dir), naming it;
    without --save-dir never (the signal ends the job at once)."""
    import signal
    from types import SimpleNamespace

    from pipetrain.checkpoint.durable import DurableRun

    def run(save_dir):
        durable = DurableRun.__new__(DurableRun)  # its stop request alone: no engine, no process group
        durable.__dict__.update(config=SimpleNamespace(save_dir=save_dir), device=torch.device("cpu"),
                                stopped_by=None)
        from pipetrain.checkpoint.stop import StopRequest
        durable._stop = StopRequest()
        return durable

    saving = run(tmp_path)
    assert not saving.stop_requested()
    saving._stop._record(signal.SIGTERM, None)
    assert saving.stop_requested() and saving.stopped_by == "SIGTERM"
    silent = run(None)
    silent._stop._record(signal.SIGTERM, None)
    assert not silent.stop_requested() and silent.stopped_by is None
