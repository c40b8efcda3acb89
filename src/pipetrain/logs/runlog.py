"""The run log: the one object the training loop feeds (`step`, `eval`, `close`), fanning each record out to the
console, `steps.jsonl`, TensorBoard and the progress sink (banner, bar, epoch lines) on rank 0, and keeping the run's
best held-out result on every rank."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from pipetrain.blocks import BlockModel, Tensors
from pipetrain.logs.config import LogConfig
from pipetrain.logs.console import ConsoleSink
from pipetrain.logs.jsonl import JsonLinesSink
from pipetrain.logs.meter import StepMeter, model_flops
from pipetrain.logs.predicted import PredictionSink
from pipetrain.logs.progress import ProgressSink
from pipetrain.logs.records import EvalRecord, StepRecord
from pipetrain.logs.stragglers import Straggler
from pipetrain.logs.tensorboard import TensorBoardSink
from pipetrain.pipeline.engine import PipelineEngine, StepResult
from pipetrain.pipeline.loss import SampleMeanLoss

__all__ = ["RunLog", "open_run_log", "Sink", "STEPS_FILE", "CONFIG_FILE"]

log = logging.getLogger("pipetrain")

STEPS_FILE = "steps.jsonl"
CONFIG_FILE = "config.toml"


class Sink(Protocol):
    """Where records go."""

    def step(self, record: StepRecord) -> None: ...

    def eval(self, record: EvalRecord) -> None: ...

    def close(self) -> None: ...


class RunLog:
    """One rank's log of a run. The loop calls `begin_step()` before each step and `step(result, ...)` after it,
    asks `due(step, epoch_end=...)` whether to evaluate, hands each evaluation to `eval(record)`, and calls
    `close()`; around them `begin_epoch` / `end_epoch`, `epoch` and `end` reach the progress sink. Only the
    `main` rank (global rank 0) measures and writes; `best` is kept on every rank (the evaluations are identical
    everywhere). `console`: log a step line every `config.log_every` steps (off under a progress bar; evaluations
    are logged either way); `bar`: a tqdm bar per epoch; `banner`: what the run is, said first."""

    def __init__(self, config: LogConfig, meter: StepMeter, *, main: bool, total_steps: int | None = None,
                 console: bool = True, best: EvalRecord | None = None, bar: bool = False,
                 banner: str | None = None) -> None:
        self.config = config
        self.meter = meter
        self.main = main
        self.best = best
        self.sinks: list[Sink] = []
        self.progress: ProgressSink | None = None
        if not main:
            return
        self.progress = ProgressSink(bar=bar)
        if banner:
            self.progress.banner(banner)
        if config.run_dir is not None:
            folder = Path(config.run_dir)
            folder.mkdir(parents=True, exist_ok=True)
            if config.config_text:
                (folder / CONFIG_FILE).write_text(config.config_text, encoding="utf-8")
            self.sinks.append(JsonLinesSink(folder / STEPS_FILE))
        if config.tensorboard is not None:
            self.sinks.append(TensorBoardSink(Path(config.tensorboard)))
        self.sinks.append(ConsoleSink(every=config.log_every, total_steps=total_steps, steps=console,
                                      straggler_factor=config.straggler_factor))
        if config.predicted is not None:
            self.sinks.append(PredictionSink(*config.predicted, total_steps=total_steps))
        self.sinks.append(self.progress)
        if config.run_dir is not None:
            log.info("pipetrain: logging to %s", Path(config.run_dir) / STEPS_FILE)

    def begin_epoch(self, epoch: int, *, total: int, done: int) -> None:
        """Epoch `epoch` of `total` steps starts, `done` of them already made (a resumed run)."""
        if self.progress is not None:
            self.progress.begin_epoch(epoch, total=total, done=done)

    def end_epoch(self) -> None:
        """The epoch's steps are done, or the run stops within them."""
        if self.progress is not None:
            self.progress.end_epoch()

    def epoch(self, line: str) -> None:
        """The line of an epoch's report (rank 0)."""
        if self.progress is not None:
            self.progress.epoch(line)

    def end(self) -> None:
        """The run ended, finished or stopped (not by an error): the best held-out result is said."""
        if self.progress is not None:
            self.progress.end(self.best_line())

    def begin_step(self) -> None:
        """A step starts now (its time is measured from here)."""
        if self.main:
            self.meter.start()

    def step(self, result: StepResult, *, step: int, epoch: int, lr: float, inputs: Tensors | None = None,
             grad_norm: float | None = None, skipped: bool = False,
             stragglers: Sequence[Straggler] = (), expert_load: dict[int, float] | None = None,
             dropped_fraction: float | None = None) -> StepRecord | None:
        """Record optimizer step `step` (its `result` from the engine, the `stragglers` named after it); returns the
        record on the main rank."""
        if not self.main:
            return None
        record = self.meter.record(result, step=step, epoch=epoch, lr=lr, inputs=inputs, grad_norm=grad_norm,
                                   skipped=skipped)
        if stragglers:
            record = replace(record, stragglers=tuple(s.as_dict() for s in stragglers))
        if expert_load or dropped_fraction is not None:  # a mixture of experts: its load (and drops) this step
            record = replace(record, expert_load=dict(expert_load or {}), dropped_fraction=dropped_fraction)
        for sink in self.sinks:
            sink.step(record)
        return record

    def due(self, step: int, *, epoch_end: bool) -> bool:
        """Whether to evaluate after step `step` (see `LogConfig.eval_due`)."""
        return self.config.eval_due(step, epoch_end=epoch_end)

    def eval(self, record: EvalRecord) -> None:
        """Record an evaluation; the lowest held-out loss so far becomes `best` (one without a loss never does)."""
        if record.loss is not None and (self.best is None or record.loss < self.best.loss):
            self.best = record
        for sink in self.sinks if self.main else ():
            sink.eval(record)

    def sample(self, step: int, prompt: str, text: str) -> None:
        """A text generated from `prompt` after step `step` (`--sample-every`): a console line, and to every sink
        that shows text (TensorBoard)."""
        if not self.main:
            return
        log.info("sample at step %d: %s -> %r", step, prompt, text)
        for sink in self.sinks:
            show = getattr(sink, "sample", None)
            if show is not None:
                show(step, prompt, text)

    def best_line(self) -> str | None:
        """e.g. ``best held-out loss 0.4012 (acc 0.812) at step 300, epoch 2``; None before any evaluation."""
        best = self.best
        if best is None:
            return None
        extra = ", ".join(([f"acc {best.accuracy:.3f}"] if best.accuracy is not None else [])
                          + ([f"ppl {best.perplexity:.2f}"] if best.perplexity is not None else []))
        return (f"best held-out loss {best.loss:.4f}" + (f" ({extra})" if extra else "")
                + f" at step {best.step}, epoch {best.epoch}")

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def open_run_log(config: LogConfig, *, model: BlockModel, engine: PipelineEngine, world_size: int, precision: str,
                 main: bool, total_steps: int | None = None, console: bool = True, bar: bool = False,
                 banner: str | None = None) -> RunLog:
    """The run log of a job training `model` on `engine` over `world_size` devices; MFU is measured when a peak
    FLOP/s is known (`config.peak_tflops`, or a GPU of `pipetrain.logs.mfu.PEAK_TFLOPS`)."""
    meter = StepMeter(device=engine.device, devices=world_size, per_token=getattr(engine.loss, "per_token", not isinstance(engine.loss, SampleMeanLoss)),
                      precision=precision, peak_tflops_=config.peak_tflops)
    if main and meter.peak is not None:
        meter.flops = model_flops(model)
    return RunLog(config, meter, main=main, total_steps=total_steps, console=console, bar=bar, banner=banner)
