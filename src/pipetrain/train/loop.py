"""The training loop on one rank of the mesh, for any registered workload (model, data and loss from the registry)."""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import json
import logging
import math
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pipetrain.checkpoint.durable import DurableConfig, DurableRun, Position
from pipetrain.config import ParallelConfig
from pipetrain.errors import ConfigError
from pipetrain.launch.ranks import RankSpec
from pipetrain.logs.config import LogConfig
from pipetrain.parallel.tensor import check_tensor_parallel
from pipetrain.logs.records import EvalRecord
from pipetrain.logs.runlog import RunLog, open_run_log
from pipetrain.pipeline import PipelineEngine, StepResult
from pipetrain.pipeline.precision import check_precision
from pipetrain.pipeline.timeline import span
from pipetrain.recipe import Recipe, RecipeConfig, StepOutcome, build_optimizer
from pipetrain.pipeline.compiled import dynamic_shapes
from pipetrain.logs.startup import StartupSink
from pipetrain.session import close_session, open_session
from pipetrain.trace.tracer import Tracer
from pipetrain.workloads.registry import Dataset, DataRequest, Workload, get_workload

__all__ = ["SYNTHETIC", "TrainConfig", "EpochReport", "MetricTotals", "load_data", "train_rank", "report_dicts"]

log = logging.getLogger("pipetrain")

#: `TrainConfig.data` (`--data`) naming the workload's synthetic corpus, and the corpus's default sizes.
SYNTHETIC = "synthetic"
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 6000, 2000


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training job: the workload and its preset, the data, the optimisation and the parallel layout."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    workload: str = "classifier"
    preset: str = "cpu"
    #: a pretrained model folder (`--model DIR`, `Workload.with_model`) and whether its text is packed (`--no-pack`)
    model_dir: Path | None = None
    pack: bool = True
    #: None: the workload's default data (`Workload.default_data`, else its synthetic corpus); SYNTHETIC: the
    #: synthetic corpus; else a folder/file
    data: Path | str | None = None
    #: sizes of the synthetic corpus (None: SYNTHETIC_TRAIN / SYNTHETIC_TEST); refused for real data
    train_samples: int | None = None
    test_samples: int | None = None
    #: tokens per sample for a workload that `windows` (None: the preset's window for this data)
    seq_len: int | None = None
    batch_size: int = 64
    #: None: the workload's default for this data (`Workload.job_defaults`)
    epochs: int | None = None
    max_steps: int | None = None
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    seed: int = 0
    #: batches of similar lengths (None: the workload's default for this data, `Workload.job_defaults`)
    bucket: bool | None = None
    progress: bool = True
    trace: Path | None = None
    trace_steps: int = 3
    trace_warmup: int = 2
    precision: str = "fp32"
    durable: DurableConfig = field(default_factory=DurableConfig)
    logs: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if isinstance(self.data, str) and self.data != SYNTHETIC:
            object.__setattr__(self, "data", Path(self.data))
        check_precision(self.precision)
        workload = self.task()
        workload.check_preset(self.preset)
        self._check_data(workload)
        for name, value in workload.job_defaults(synthetic=self.synthetic).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.bucket and self.parallel.pipeline.compile:  # lengths vary per batch: compile with symbolic shapes
            object.__setattr__(self, "parallel", dynamic_shapes(self.parallel))
        if self.bucket and not workload.buckets:
            raise ConfigError(f"workload {self.workload!r} has samples of one length: --bucket does not apply",
                              hint="drop --bucket")
        for name in ("batch_size", "epochs", "train_samples", "test_samples", "seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be positive, got {value}", hint=f"pass a {name} of 1 or more")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be positive, got {self.max_steps}", hint="pass --max-steps 1 or more")
        if self.trace is not None and (self.trace_steps < 1 or self.trace_warmup < 0):
            raise ConfigError(f"--trace with {self.trace_steps} traced step(s) after {self.trace_warmup} warm-up "
                              "step(s) records nothing", hint="pass --trace-steps 1 or more and --trace-warmup 0 or more")
        if self.trace is not None and self.max_steps is not None and self.max_steps <= self.trace_warmup:
            raise ConfigError(f"--trace records no step: --max-steps {self.max_steps} ends within the "
                              f"{self.trace_warmup} warm-up step(s) before tracing",
                              hint=f"pass --max-steps {self.trace_warmup + self.trace_steps} or more, or lower --trace-warmup")
        self.parallel.check_global_batch(self.batch_size)
        self.parallel.pipeline.check_blocks(self.model().num_blocks)
        check_tensor_parallel(self.model(), self.parallel.tp, sequence_parallel=self.parallel.sequence_parallel,
                              loss_parallel=self.parallel.loss_parallel)

    def _check_data(self, workload: Workload) -> None:
        if not self.synthetic:
            for flag, value in (("--train-samples", self.train_samples), ("--test-samples", self.test_samples)):
                if value is not None:
                    raise ConfigError(f"{flag} {value} sizes the synthetic corpus, but this job trains on "
                                      f"{self.data or workload.default_data}",
                                      hint=f"pass --data {SYNTHETIC} to train on the synthetic corpus, or drop {flag}")
        if self.seq_len is not None and not workload.windows:
            raise ConfigError(f"workload {self.workload!r} has no window to change: --seq-len does not apply",
                              hint="drop --seq-len (the preset sets the length)")

    @property
    def synthetic(self) -> bool:
        """Whether this job trains on the workload's synthetic corpus."""
        return self.data == SYNTHETIC or (self.data is None and self.task().default_data is None)

    @property
    def window(self) -> int | None:
        """Tokens per sample (None for a workload whose preset alone sets it)."""
        return self.task().window(self.preset, seq_len=self.seq_len, synthetic=self.synthetic)

    @property
    def lr(self) -> float:
        """The peak learning rate (`recipe.lr`)."""
        return self.recipe.lr

    def total_steps(self, train: Dataset) -> int:
        """The optimizer steps of the whole run on `train` (epochs of batches, or --max-steps when fewer)."""
        per_epoch = self.task().num_batches(train, self.batch_size, replicas=self.parallel.dp)
        return per_epoch * self.epochs if self.max_steps is None else min(per_epoch * self.epochs, self.max_steps)

    def task(self) -> Workload:
        """The registered workload this job trains (on `model_dir` when set)."""
        workload = get_workload(self.workload)
        return workload if self.model_dir is None else workload.with_model(self.model_dir, pack=self.pack)

    def model(self):
        """The workload's model for this preset and window (a `BlockModel`)."""
        task = self.task()
        return task.model(self.preset, seq_len=self.window) if task.windows else task.model(self.preset)

    def model_name(self) -> str:
        """`workload:preset`, the model a checkpoint of this job belongs to."""
        return f"{self.workload}:{self.preset}"

    def as_json(self) -> dict:
        """This configuration as JSON data (recorded in checkpoints)."""
        return json.loads(json.dumps(asdict(self), default=str))


def _accept_old_lr(init: Callable[..., None]) -> Callable[..., None]:
    """`TrainConfig(lr=...)`, the spelling before the recipe (deprecated in 0.2): its value becomes `recipe.lr`."""

    @functools.wraps(init)
    def __init__(self, *args: Any, lr: float | None = None, **kwargs: Any) -> None:
        if lr is not None:
            warnings.warn("TrainConfig(lr=) is deprecated: pass recipe=RecipeConfig(lr=...)", DeprecationWarning,
                          stacklevel=2)
            kwargs["recipe"] = replace(kwargs.get("recipe", RecipeConfig()), lr=lr)
        init(self, *args, **kwargs)

    return __init__


TrainConfig.__init__ = _accept_old_lr(TrainConfig.__init__)  # type: ignore[method-assign]


@dataclass(frozen=True)
class EpochReport:
    """What one epoch measured (global figures, identical on every rank). Accuracy is per sample for a
    classifier and per token for a language model; perplexity is None unless the workload reports it."""

    epoch: int
    steps: int
    train_loss: float
    train_accuracy: float
    test_loss: float
    test_accuracy: float
    seconds: float
    synthetic: bool
    data: str = ""
    train_perplexity: float | None = None
    test_perplexity: float | None = None
    best_eval: dict | None = None  # the lowest held-out loss so far (an EvalRecord as a dict)
    #: what the `test_*` figures were measured on: "test", "held-out", "synthetic test", ...
    eval_split: str = "test"

    def line(self, epochs: int) -> str:
        def ppl(value: float | None) -> str:
            return "" if value is None else f" ppl {value:.2f}"

        return (
            f"epoch {self.epoch}/{epochs}  train loss {self.train_loss:.4f} acc {self.train_accuracy:.3f}"
            f"{ppl(self.train_perplexity)}  {self.eval_split} loss {self.test_loss:.4f} acc {self.test_accuracy:.3f}"
            f"{ppl(self.test_perplexity)}  time {self.seconds:.1f}s  steps {self.steps}  ({self.data})"
        )


class MetricTotals:
    """Running means of loss and accuracy over steps, each step weighted by what its loss averages over."""

    def __init__(self, loss: float = 0.0, correct: float = 0.0, count: float = 0.0) -> None:
        self.loss, self.correct, self.count = loss, correct, count

    def add(self, result: StepResult) -> None:
        self.loss += result.loss * result.count
        self.correct += (result.accuracy or 0.0) * result.count
        self.count += result.count

    def means(self) -> tuple[float, float]:
        count = max(self.count, 1.0)
        return self.loss / count, self.correct / count


def load_data(config: TrainConfig) -> tuple[Dataset, Dataset]:
    """The job's train and evaluation data: its synthetic corpus, the folder/file `config.data`, or (no data named)
    the workload's default data."""
    synthetic = config.synthetic
    request = DataRequest(preset=config.preset, path=None if synthetic else config.data, synthetic=synthetic,
                          train_samples=config.train_samples or SYNTHETIC_TRAIN,
                          test_samples=config.test_samples or SYNTHETIC_TEST, seed=config.seed, seq_len=config.window)
    return config.task().load_data(request)


def _evaluate(engine: PipelineEngine, workload: Workload, test: Dataset, config: TrainConfig, dp_rank: int,
              durable: DurableRun, limit: int | None = None) -> MetricTotals:
    totals = MetricTotals()
    for x, y in itertools.islice(workload.batches(test, config.batch_size, shuffle=False, seed=config.seed, epoch=0,
                                                  replica=dp_rank, replicas=config.parallel.dp, bucket=config.bucket),
                                 limit):
        totals.add(engine.evaluate(x, y))
        durable.progress()
    return totals


def _held_out(engine: PipelineEngine, workload: Workload, test: Dataset, config: TrainConfig, dp_rank: int,
              durable: DurableRun, at: Position, trigger: str, limit: int | None = None) -> tuple[MetricTotals, EvalRecord]:
    """`_evaluate`, and its figures as the run log's record of an evaluation after step `at.step`."""
    start = time.perf_counter()
    tested = _evaluate(engine, workload, test, config, dp_rank, durable, limit)
    loss, accuracy = tested.means()
    batches = workload.num_batches(test, config.batch_size, replicas=config.parallel.dp)
    return tested, EvalRecord(step=at.step, epoch=at.epoch, loss=loss, trigger=trigger,
                              accuracy=accuracy if "accuracy" in workload.metrics else None,
                              perplexity=_perplexity(workload, loss), batches=min(batches, limit or batches),
                              seconds=time.perf_counter() - start)


def _perplexity(workload: Workload, loss: float) -> float | None:
    return math.exp(min(loss, 700.0)) if "perplexity" in workload.metrics else None


def train_rank(spec: RankSpec, config: TrainConfig, data: tuple[Dataset, Dataset] | None = None) -> list[EpochReport]:
    """Train on this rank (one of dp × pp); every rank returns the same epoch reports."""
    workload = config.task()
    train, test = data if data is not None else load_data(config)
    tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: a killed rank would leak its semaphore
    session = open_session(spec, config.model(), config.parallel, seed=config.seed, loss_fn=workload.loss(),
                           precision=config.precision, timeout_s=config.durable.process_group_timeout_s)
    try:
        engine, mesh = session.engine, session.mesh
        engine.keep_outputs = False  # the loop reads the metrics only: no full-batch logits held between steps
        optimizer = build_optimizer(engine, config.recipe.lr, config.recipe.weight_decay)
        recipe = Recipe(config.recipe, optimizer, engine, config.total_steps(train), save_dir=config.durable.save_dir)
        dp = config.parallel.dp
        if session.is_main:
            window = "" if config.window is None else f", window {config.window}"
            data = (f"{train.source} (evaluation: {len(test):,} {workload.eval_split(test)} samples{window}"
                    f"{', bucketed' if config.bucket else ''})")
            log.info(
                "pipetrain: %s | workload %s, preset %s | dp=%d (%s) x pp=%s | schedule %s, chunks %d, recompute %s | "
                "balance %s | %s | device %s",
                data, workload.name, config.preset, dp, config.parallel.dp_mode, config.parallel.mesh_text,
                config.parallel.pipeline.schedule, config.parallel.pipeline.n_microbatches,
                config.parallel.pipeline.checkpoint, engine.balance, config.precision, session.device,
            )
        tracer = (Tracer(engine, config.trace, steps=config.trace_steps, warmup=config.trace_warmup)
                  if config.trace is not None else None)
        durable = DurableRun(config.durable, engine, optimizer, model_name=config.model_name(),
                             job_config=config.as_json(), device=session.device, spec=spec)
        run_log = open_run_log(config.logs, model=config.model(), engine=engine, world_size=spec.world_size,
                               precision=config.precision, main=session.is_main, console=not config.progress,
                               total_steps=config.total_steps(train))
        if session.is_main:  # one line after the first step: the start-up's seconds by phase
            run_log.sinks.append(StartupSink(session.startup))
        try:
            reports = _train_epochs(config, workload, engine, recipe, train, test, mesh.dp_rank, durable, tracer,
                                    run_log, show=session.is_main)
            durable.finish()
        finally:
            durable.close()
            run_log.close()
        if session.is_main and run_log.best_line():
            log.info("pipetrain: %s", run_log.best_line())
        if tracer is not None and tracer.traced_steps == 0:  # e.g. stopped by a signal during the warm-up
            if session.is_main:
                log.info("pipetrain: the run stopped before any step was traced: no trace written")
            tracer = None
        files = tracer.close() if tracer is not None else None
        if files is not None:
            for line in [f"trace of {tracer.traced_steps} step(s): {files.trace} (open in ui.perfetto.dev), {files.gantt}",
                         *files.lines()]:
                log.info("pipetrain: %s", line)
        return reports
    finally:  # after an error (propagating here, so in sys.exc_info()): no blocking destroy before it is reported
        close_session(after_error=sys.exc_info()[1] is not None)


def _train_epochs(config: TrainConfig, workload: Workload, engine: PipelineEngine, recipe: Recipe,
                  train: Dataset, test: Dataset, dp_rank: int, durable: DurableRun, tracer: Tracer | None,
                  run_log: RunLog, *, show: bool) -> list[EpochReport]:
    """The epochs of the job from where `durable` resumes it; returns the reports of every epoch so far."""
    dp = config.parallel.dp
    per_epoch = workload.num_batches(train, config.batch_size, replicas=dp)
    at = durable.start()
    recipe.load_state_dict(at.recipe)
    reports = [EpochReport(**report) for report in at.reports]
    run_log.best = EvalRecord(**reports[-1].best_eval) if reports and reports[-1].best_eval else None
    for epoch in range(at.epoch, config.epochs + 1):
        if config.max_steps is not None and at.step >= config.max_steps:
            break
        start = time.perf_counter()
        totals = MetricTotals(**at.totals)
        total = per_epoch if config.max_steps is None else min(per_epoch, at.in_epoch + config.max_steps - at.step)
        stream = workload.batches(train, config.batch_size, shuffle=True, seed=config.seed, epoch=epoch,
                                  replica=dp_rank, replicas=dp, bucket=config.bucket)
        bar = tqdm(total=total, initial=at.in_epoch, desc=f"epoch {epoch}", unit="step",
                   disable=not (show and config.progress), leave=False, dynamic_ncols=True)
        for x, y in itertools.islice(stream, at.in_epoch, total):  # the batches this epoch has not done yet
            run_log.begin_step()
            with tracer.step() if tracer is not None else nullcontext():
                recipe.optimizer.zero_grad(set_to_none=True)
                result = engine.step(x, y)
                with span("optimizer"):
                    outcome: StepOutcome = recipe.step(at.step, result)  # guard, clip, LR, optimizer step
            if not outcome.skipped:  # a skipped step's non-finite loss stays out of the epoch's means
                totals.add(result)
            at = Position(at.step + 1, epoch, at.in_epoch + 1, vars(totals).copy(), at.reports, recipe.state_dict())
            run_log.step(result, step=at.step, epoch=epoch, lr=outcome.lr, inputs=x, grad_norm=outcome.grad_norm,
                         skipped=outcome.skipped)
            if run_log.due(at.step, epoch_end=at.in_epoch == total):
                run_log.eval(_held_out(engine, workload, test, config, dp_rank, durable, at, "every",
                                       config.logs.eval_batches)[1])
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{outcome.lr:.2e}", grad_norm=f"{outcome.grad_norm:.3f}")
            bar.update()
            if durable.after_step(at):
                bar.close()
                _stopped(durable, at, show)
                return reports
        bar.close()
        partial = at.in_epoch < per_epoch  # --max-steps ends the job inside this epoch
        if partial:
            durable.save(at)  # a resumed job goes on with the rest of this epoch
        tested, held_out = _held_out(engine, workload, test, config, dp_rank, durable, at, "epoch")
        run_log.eval(held_out)
        (train_loss, train_accuracy), (test_loss, test_accuracy) = totals.means(), tested.means()
        report = EpochReport(epoch, at.step, train_loss, train_accuracy, test_loss, test_accuracy,
                             time.perf_counter() - start, train.synthetic, workload.describe_data(train),
                             _perplexity(workload, train_loss), _perplexity(workload, test_loss),
                             asdict(run_log.best) if run_log.best else None, workload.eval_split(test))
        reports.append(report)
        if show:
            log.info(report.line(config.epochs))
        if partial:
            break
        at = Position(at.step, epoch + 1, 0, {}, report_dicts(reports), recipe.state_dict())
        durable.end_epoch(at)
    return reports


def _stopped(durable: DurableRun, at: Position, show: bool) -> None:
    if show:
        log.info("pipetrain: stopped by %s after step %d; saved in %s; run again with --resume to continue",
                 durable.stopped_by, at.step, durable.config.save_dir)
    durable.requeue()


def report_dicts(reports: list[EpochReport]) -> list[dict]:
    """Epoch reports as plain dicts (for JSON output)."""
    return [asdict(report) for report in reports]
