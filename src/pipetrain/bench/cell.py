"""One benchmark cell on one rank: warm-up, timed optimizer steps and the rank's peak memory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.bench.grid import Cell
from pipetrain.launch.memory import (
    apply_memory_limit,
    is_oom_error,
    lift_memory_limit,
    oom_reason,
    peak_memory_mb,
    peak_reserved_mb,
    reset_peak_memory,
)
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.ranks import RankSpec
from pipetrain.parallel import pick_device
from pipetrain.pipeline.clock import clock_for
from pipetrain.session import close_session, open_session
from pipetrain.trace.tracer import Tracer
from pipetrain.workloads.registry import DataRequest, Workload, get_workload

__all__ = ["measure_rank", "parallel_config", "cell_workload", "TRACED_STEPS"]

#: Steps traced after the timed ones, for the measured-bubble column (not part of the step times).
TRACED_STEPS = 2


def cell_workload(cell: Cell) -> tuple[Workload, str]:
    """The workload and preset of a cell: `preset` is `PRESET` (the classifier's) or `WORKLOAD:PRESET`."""
    name, _, preset = cell.preset.rpartition(":")
    workload = get_workload(name or "classifier")
    workload.check_preset(preset)
    return workload, preset


def parallel_config(cell: Cell) -> ParallelConfig:
    """The mesh a cell runs on."""
    pipeline = PipelineConfig(pp=cell.pp, schedule=cell.schedule, n_microbatches=cell.chunks, checkpoint=cell.checkpoint)
    return ParallelConfig(dp=cell.dp, pipeline=pipeline, tp=getattr(cell, "tp", 1), dp_mode=cell.dp_mode)


def measure_rank(spec: RankSpec, cell: Cell, warmup: int, steps: int, out_dir: str, trace_dir: str | None = None) -> None:
    """Run the cell's steps on this rank; rank 0 writes `result.json`, a failing rank its `rank<N>.json`.

    After the timed steps, `TRACED_STEPS` more are traced for the measured bubble (their files go to
    `trace_dir` when given)."""
    device = pick_device(spec.local_rank, spec.device)
    out = Path(out_dir)
    apply_memory_limit(cell.mem_limit_mb, device)
    try:
        times, peaks, bubble = _measure(spec, cell, warmup, steps, device, trace_dir)
    except Exception as exc:
        status = "oom" if is_oom_error(exc) else "error"
        reason = oom_reason(exc, device) if status == "oom" else f"{type(exc).__name__}: {exc}".splitlines()[0]
        lift_memory_limit(device)  # so that writing this report and the launcher's one cannot fail in turn
        (out / f"rank{spec.rank}.json").write_text(json.dumps({"status": status, "reason": reason}))
        close_session(after_error=True)  # the report first, then no blocking destroy (NCCL can hang in it)
        raise
    close_session()
    if spec.rank == 0:
        (out / "result.json").write_text(json.dumps({"step_times_s": times, "peak_mem_mb_per_stage": peaks[0],
                                                     "peak_reserved_mb_per_stage": peaks[1],
                                                     "measured_bubble": bubble}))


def _measure(
    spec: RankSpec, cell: Cell, warmup: int, steps: int, device: torch.device, trace_dir: str | None
) -> tuple[list[float], tuple[list[float], list[float] | None], float | None]:
    workload, preset = cell_workload(cell)
    session = open_session(spec, workload.model(preset), parallel_config(cell), seed=0, loss_fn=workload.loss())
    # no `finally: close_session()`: measure_rank closes it, after reporting a failure
    engine = session.engine
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    train, _ = workload.load_data(DataRequest(preset=preset, path=None, synthetic=True,  # never real data
                                              train_samples=cell.batch_size, test_samples=1, seed=0))
    x, y = next(iter(workload.batches(train, cell.batch_size, shuffle=False, seed=0, epoch=0,
                                      replica=session.mesh.dp_rank, replicas=cell.dp)))
    reset_peak_memory(device)
    times, clock = [], clock_for(device)

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        engine.step(x, y)  # ends with a collective over the whole job: every rank has finished
        optimizer.step()

    for index in range(warmup + steps):
        seconds = clock.seconds(one_step)  # on CUDA: to the end of the queued work
        if index >= warmup:
            times.append(seconds)
    peaks: list = [None] * dist.get_world_size()  # (allocated, reserved or None on the CPU) per rank
    dist.all_gather_object(peaks, (peak_memory_mb(device), peak_reserved_mb(device)))
    stage_ranks = [[r for r in range(len(peaks)) if (r // cell.tp) % cell.pp == pp_rank] for pp_rank in range(cell.pp)]
    per_stage = [max(peaks[r][0] for r in ranks) for ranks in stage_ranks]  # rank = (dp_rank * pp + pp_rank) * tp + tp_rank
    reserved = None if peaks[0][1] is None else [max(peaks[r][1] for r in ranks) for ranks in stage_ranks]
    tracer = Tracer(engine, trace_dir, steps=TRACED_STEPS, warmup=0)
    for _ in range(TRACED_STEPS):
        with tracer.step():
            optimizer.zero_grad(set_to_none=True)
            engine.step(x, y)
            with tracer.span("optimizer"):
                optimizer.step()
    traced = tracer.close()
    return times, (per_stage, reserved), traced.mean_bubble if traced is not None else None
