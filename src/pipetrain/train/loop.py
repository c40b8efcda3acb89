"""The training loop on one rank of the mesh, for any registered workload (model, data and loss from the registry)."""

from __future__ import annotations

import hashlib
import itertools
import logging
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from pipetrain.checkpoint.durable import DurableRun, Position
from pipetrain.generate.engine import TrainingSamples
from pipetrain.launch.env import enable_flight_recorder
from pipetrain.launch.hangs import HANG_FOLDER
from pipetrain.launch.ranks import RankSpec
from pipetrain.logs.records import EpochReport, EvalRecord, MetricTotals, perplexity, report_dicts
from pipetrain.logs.runlog import RunLog, open_run_log
from pipetrain.logs.stragglers import StragglerWatch
from pipetrain.moe.balance import ExpertBalancer, routed_blocks
from pipetrain.logs.startup import StartupSink
from pipetrain.parallel.mesh import Mesh
from pipetrain.pipeline import PipelineEngine
from pipetrain.pipeline.timeline import span
from pipetrain.recipe import Recipe, StepOutcome, build_optimizer
from pipetrain.session import Session, close_session, open_session
from pipetrain.trace.tracer import Tracer
from pipetrain.train.config import SYNTHETIC, SYNTHETIC_TEST, SYNTHETIC_TRAIN, TrainConfig, load_data
from pipetrain.train.resume_changes import changes_warning, recipe_changes
from pipetrain.workloads.evaluation import evaluation_batches
from pipetrain.workloads.registry import Dataset, Workload

#: TrainConfig, load_data, SYNTHETIC (train/config.py), EpochReport, MetricTotals, report_dicts (logs/records.py)
#: are imported from here too, as they were from `pipetrain.trainer`.
__all__ = ["SYNTHETIC", "SYNTHETIC_TRAIN", "SYNTHETIC_TEST", "TrainConfig", "EpochReport", "MetricTotals", "load_data",
           "train_rank", "report_dicts", "expert_balancer", "evaluate_split"]

log = logging.getLogger("pipetrain")


def evaluate_split(engine: PipelineEngine, workload: Workload, test: Dataset, config: TrainConfig, dp_rank: int,
                   limit: int | None = None, progress: Callable[[], None] | None = None,
                   stop: Callable[[], bool] | None = None) -> tuple[MetricTotals | None, int]:
    """The figures of `test`'s first `limit` global batches (None: all) added up, and how many batches that was:
    every sample of them counted once, whatever dp (`workloads.evaluation`). `progress` is called after each batch,
    then `stop`: when it answers True (a stop signal, the same answer on every rank) the evaluation ends there and
    its figures are None."""
    totals, batches = MetricTotals(), 0
    shares = evaluation_batches(workload, test, config.batch_size, seed=config.seed, replica=dp_rank,
                                replicas=config.parallel.dp, bucket=config.bucket)
    for (x, y), rows in itertools.islice(shares, limit):
        totals.add(engine.evaluate(x, y, rows=rows))
        batches += 1
        if progress is not None:
            progress()
        if stop is not None and stop():
            return None, batches
    return totals, batches


def _held_out(engine: PipelineEngine, workload: Workload, test: Dataset, config: TrainConfig, dp_rank: int,
              durable: DurableRun, at: Position, trigger: str,
              limit: int | None = None) -> tuple[MetricTotals, EvalRecord] | None:
    """`evaluate_split`, and its figures as the run log's record of an evaluation after step `at.step` (None: stopped
    by a signal); for an objective that rolls out (GRPO) the held-out prompts' rewards instead, with no loss."""
    start = time.perf_counter()
    rewards = getattr(workload, "held_out_rewards", None)  # GRPO: greedy completions scored, a bounded number
    if rewards is not None:
        tested = rewards(test, replica=dp_rank, replicas=config.parallel.dp)
        durable.progress()
        return tested, EvalRecord(step=at.step, epoch=at.epoch, loss=None, trigger=trigger, batches=1,
                                  seconds=time.perf_counter() - start, extras=tested.extra_means())
    tested, batches = evaluate_split(engine, workload, test, config, dp_rank, limit, durable.progress,
                                     durable.stop_requested)
    if tested is None:
        return None
    loss, accuracy = tested.means()
    return tested, EvalRecord(step=at.step, epoch=at.epoch, loss=loss, trigger=trigger,
                              accuracy=accuracy if "accuracy" in workload.metrics else None,
                              perplexity=perplexity(loss, workload.metrics), batches=batches,
                              seconds=time.perf_counter() - start, extras=tested.extra_means())


def _banner(config: TrainConfig, workload: Workload, session: Session, train: Dataset, test: Dataset) -> str:
    """What the run is, said once by rank 0: data, workload, mesh, schedule, balance, precision, device."""
    parallel, pipeline = config.parallel, config.parallel.pipeline
    window = "" if config.window is None else f", window {config.window}"
    data = (f"{train.source} (evaluation: {len(test):,} {workload.eval_split(test)} samples{window}"
            f"{', bucketed' if config.bucket else ''})")
    return (f"{data} | workload {workload.name}, preset {config.preset} | dp={parallel.dp} ({parallel.dp_text}) x "
            f"pp={parallel.mesh_text} | schedule {pipeline.schedule}, chunks {pipeline.n_microbatches}, recompute "
            f"{pipeline.recompute_text} | balance {session.engine.balance} | {config.precision} | device {session.device}"
            f" | {_length(config, workload, train)}")


def _length(config: TrainConfig, workload: Workload, train: Dataset) -> str:
    """The run's length: its steps, and the epochs they go through (as many as --max-steps needs, when it is set
    without --epochs)."""
    per_epoch = workload.num_batches(train, config.batch_size, replicas=config.parallel.dp)
    epochs = config.epochs_of(train)
    return (f"{config.total_steps(train):,} steps, {epochs} epoch{'s' if epochs != 1 else ''} of {per_epoch:,} "
            f"batches{' (from --max-steps)' if config.epochs is None else ''}")


def seed_rank(seed: int, mesh: Mesh) -> None:
    """Seed this rank's default generators (dropout) from the job's seed, its replica and its stage, so that a run
    is the same from the same seed; the tensor-parallel ranks of a stage share one stream (their replicated
    activations drop the same elements). A resumed job then restores the stream its checkpoint saved."""
    digest = hashlib.blake2b(f"dropout:{seed}:{mesh.dp_rank}:{mesh.pp_rank}".encode(), digest_size=8).digest()
    torch.manual_seed(int.from_bytes(digest, "little") >> 1)


def train_rank(spec: RankSpec, config: TrainConfig, data: tuple[Dataset, Dataset] | None = None) -> list[EpochReport]:
    """Train on this rank (one of dp × pp); every rank returns the same epoch reports."""
    workload = config.task()
    train, test = data if data is not None else load_data(config)
    hang_dir = None if config.logs.run_dir is None else Path(config.logs.run_dir) / HANG_FOLDER
    if config.durable.step_timeout_s and torch.cuda.is_available():  # NCCL's flight recorder, for hang reports
        enable_flight_recorder(None if hang_dir is None else str(hang_dir / "nccl-timeout-rank-"))
    session = open_session(spec, config.model(), config.parallel, seed=config.seed, loss_fn=workload.loss(),
                           precision=config.precision, timeout_s=config.durable.process_group_timeout_s)
    try:
        engine = session.engine
        seed_rank(config.seed, session.mesh)
        engine.keep_outputs = False  # the loop reads the metrics only: no full-batch logits held between steps
        before = getattr(workload, "before_training", None)  # an objective's pass before any step (DPO's reference)
        if before is not None:  # by the initial weights: before a checkpoint's are loaded
            before(engine, {"train": train, "test": test}, mesh=session.mesh, batch_size=config.batch_size,
                   store=config.durable.save_dir, main=session.is_main)
        optimizer = build_optimizer(engine, config.recipe.lr, config.recipe.weight_decay)
        recipe = Recipe(config.recipe, optimizer, engine, config.total_steps(train), save_dir=config.durable.save_dir)
        tracer = (Tracer(engine, config.trace, steps=config.trace_steps, warmup=config.trace_warmup)
                  if config.trace is not None else None)
        durable = DurableRun(config.durable, engine, optimizer, model_name=config.model_name(),
                             job_config=config.as_json(), device=session.device, spec=spec, hang_dir=hang_dir,
                             data_digest=config.data_digest() if config.durable.save_dir is not None else None)
        run_log = open_run_log(config.logs, model=config.model(), engine=engine, world_size=spec.world_size,
                               precision=config.precision, main=session.is_main, console=not config.progress,
                               bar=config.progress, total_steps=config.total_steps(train),
                               banner=_banner(config, workload, session, train, test) if session.is_main else None)
        if session.is_main:  # one line after the first step: the start-up's seconds by phase
            run_log.sinks.append(StartupSink(session.startup))
        samples = None if config.logs.sample_every is None else TrainingSamples(
            engine, session.mesh, config.model().config, Path(config.model_dir), config.logs.sample_prompt,
            config.logs.sample_tokens)
        try:
            reports = _train_epochs(config, workload, engine, recipe, train, test, session.mesh, durable,
                                    tracer, run_log, samples)
            durable.finish()
        finally:
            durable.close()
            run_log.close()
        run_log.end()
        if tracer is not None:
            tracer.finish(say=session.is_main)
        return reports
    finally:  # after an error (propagating here, so in sys.exc_info()): no blocking destroy before it is reported
        close_session(after_error=sys.exc_info()[1] is not None)


def expert_balancer(engine: PipelineEngine, mesh: Mesh) -> ExpertBalancer | None:
    """The expert load of a mixture of experts (its MoE layer blocks on this rank; None for a dense model)."""
    if not getattr(engine.model, "routed", False):
        return None
    # the ranks holding the same layers: the dp replicas and, beside context parallelism, their cp ranks (each
    # counts its part of the sequences)
    return ExpertBalancer(routed_blocks(engine.modules), mesh.dp_group if mesh.replicas > 1 else None)


def _expert_load(balancer: ExpertBalancer, step: int, every: int, main: bool,
                 capacity: float | None) -> dict[str, object]:
    """After a step: the counts summed over the replicas, the biases moved; each layer's load imbalance and (with a
    `capacity`) the fraction of token-slots dropped, gathered from every pipeline rank (each holds other layers):
    the step record's fields (`expert_load`, `dropped_fraction`); every `every` steps the main rank says them."""
    imbalance = balancer.after_step()
    gathered: list[tuple] = [({}, {}) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(gathered, (imbalance, balancer.dropped))
    load = {k: v for part, _ in gathered for k, v in part.items()}
    slots = {k: v for _, part in gathered for k, v in part.items()}  # the replicas of a layer: the same figures
    routed = sum(total for _, total in slots.values())
    dropped = None if capacity is None else sum(lost for lost, _ in slots.values()) / max(routed, 1.0)
    if main and step % every == 0:
        log.info("step %d: %s", step, balancer.line(load, dropped))
    return {"expert_load": dict(sorted(load.items())), "dropped_fraction": dropped}


def _train_epochs(config: TrainConfig, workload: Workload, engine: PipelineEngine, recipe: Recipe, train: Dataset,
                  test: Dataset, mesh: Mesh, durable: DurableRun, tracer: Tracer | None,
                  run_log: RunLog, samples: TrainingSamples | None = None) -> list[EpochReport]:
    """The epochs of the job from where `durable` resumes it; returns the reports of every epoch so far."""
    dp_rank = mesh.dp_rank
    per_epoch = workload.num_batches(train, config.batch_size, replicas=config.parallel.dp)
    epochs, size = config.epochs_of(train), len(train)
    at = durable.start()
    if run_log.main and (changed := recipe_changes(durable.resumed_config or {}, durable.job_config)):
        log.warning(changes_warning(changed))  # legitimate (a new --lr on resume), but never silent
    recipe.load_state_dict(at.recipe)
    watch = StragglerWatch(engine, every=config.logs.log_every, factor=config.logs.straggler_factor,
                           dp=config.parallel.dp, dp_rank=mesh.dp_rank, pp_rank=mesh.pp_rank, tp_rank=mesh.tp_rank)
    reports = [EpochReport(**report) for report in at.reports]
    rollouts, sampled = getattr(workload, "step_metrics", None), getattr(workload, "rollout_sample", None)
    balancer = expert_balancer(engine, mesh)
    run_log.best = EvalRecord(**reports[-1].best_eval) if reports and reports[-1].best_eval else None
    for epoch in range(at.epoch, epochs + 1):
        if config.max_steps is not None and at.step >= config.max_steps:
            break
        start = time.perf_counter()
        totals = MetricTotals(**at.totals)
        total = per_epoch if config.max_steps is None else min(per_epoch, at.in_epoch + config.max_steps - at.step)
        # the batches this epoch has not done yet, from the global sample where they start (seeking, not replaying)
        stream = workload.batches_from(train, config.batch_size, seed=config.seed, epoch=epoch, replica=dp_rank,
                                       replicas=config.parallel.dp, bucket=config.bucket,
                                       start=min(at.start(config.batch_size), size))
        run_log.begin_epoch(epoch, total=total, done=at.in_epoch)
        for x, y in itertools.islice(stream, max(0, total - at.in_epoch)):
            run_log.begin_step()
            with tracer.step() if tracer is not None else nullcontext(False) as traced:
                recipe.optimizer.zero_grad(set_to_none=True)
                with watch.measure(at.step + 1, busy=bool(traced)):
                    result = engine.step(x, y)
                with span("optimizer"):
                    outcome: StepOutcome = recipe.step(at.step, result)  # guard, clip, LR, optimizer step
            if rollouts is not None:  # an objective's own figures of the step (GRPO: rewards, lengths)
                result = replace(result, extras={**result.extras, **rollouts()})
            experts = {}
            if balancer is not None:  # expert load: biases moved, imbalance (and drops) recorded, said every log_every
                experts = _expert_load(balancer, at.step + 1, config.logs.log_every, run_log.main, config.moe_capacity)
            if not outcome.skipped:  # a skipped step's non-finite loss stays out of the epoch's means
                totals.add(result)
            here = min(at.start(config.batch_size), size)  # (a checkpoint without `sample`: full batches before)
            read = min(config.batch_size, size - here)  # a last short batch: the rest of the epoch
            at = Position(at.step + 1, epoch, at.in_epoch + 1, vars(totals).copy(), at.reports, recipe.state_dict(),
                          sample=here + read, samples=at.samples + read)
            run_log.step(result, step=at.step, epoch=epoch, lr=outcome.lr, inputs=x, grad_norm=outcome.grad_norm,
                         skipped=outcome.skipped, stragglers=watch.compare(at.step), **experts)
            if sampled is not None and at.step % config.logs.log_every == 0 and sampled() is not None:
                run_log.sample(at.step, *sampled())  # GRPO: a completion of this step and its reward
            if samples is not None and at.step % config.logs.sample_every == 0:  # text through the same stages
                run_log.sample(at.step, config.logs.sample_prompt, samples.text())
            if run_log.due(at.step, epoch_end=at.in_epoch == total) and (held := _held_out(
                    engine, workload, test, config, dp_rank, durable, at, "every", config.logs.eval_batches)):
                run_log.eval(held[1])  # (None: stopped during it, which after_step says)
            if durable.after_step(at):
                run_log.end_epoch()
                _stopped(durable, at, run_log.main)
                return reports
        run_log.end_epoch()
        partial = at.in_epoch < per_epoch  # --max-steps ends the job inside this epoch
        if partial:
            durable.save(at)  # a resumed job goes on with the rest of this epoch
        held = _held_out(engine, workload, test, config, dp_rank, durable, at, "epoch", config.logs.eval_batches)
        if held is None:  # a stop signal during it: saved as after the epoch's last step (a resume evaluates
            durable.after_step(at)  # again, unless --max-steps ended the run there: as after a stop at that step)
            _stopped(durable, at, run_log.main)
            return reports
        tested, held_out = held
        run_log.eval(held_out)
        report = EpochReport.of(epoch, at.step, totals, tested, seconds=time.perf_counter() - start,
                                synthetic=train.synthetic, data=workload.describe_data(train),
                                metrics=workload.metrics, best=run_log.best, eval_split=workload.eval_split(test),
                                held_out=held_out)
        reports.append(report)
        run_log.epoch(report.line(epochs))
        if partial:
            break
        at = Position(at.step, epoch + 1, 0, {}, report_dicts(reports), recipe.state_dict(), samples=at.samples)
        durable.end_epoch(at)
    return reports


def _stopped(durable: DurableRun, at: Position, show: bool) -> None:
    if show:
        log.info("pipetrain: stopped by %s after step %d; saved in %s; run again with --resume to continue",
                 durable.stopped_by, at.step, durable.config.save_dir)
    durable.requeue()
