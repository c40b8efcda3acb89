"""One benchmark cell on one rank: warm-up, timed optimizer steps and the rank's peak memory."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.bench.grid import Cell
from pipetrain.bench.memory import (
    apply_memory_limit,
    is_oom_error,
    lift_memory_limit,
    oom_reason,
    peak_memory_mb,
    reset_peak_memory,
)
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.spawn import RankSpec
from pipetrain.parallel import pick_device
from pipetrain.session import close_session, open_session
from pipetrain.workloads.transformer import PRESETS, TransformerClassifier

__all__ = ["measure_rank", "parallel_config"]


def parallel_config(cell: Cell) -> ParallelConfig:
    """The mesh a cell runs on."""
    pipeline = PipelineConfig(pp=cell.pp, schedule=cell.schedule, n_microbatches=cell.chunks, checkpoint=cell.checkpoint)
    return ParallelConfig(dp=cell.dp, pipeline=pipeline)


def measure_rank(spec: RankSpec, cell: Cell, warmup: int, steps: int, out_dir: str) -> None:
    """Run the cell's steps on this rank; rank 0 writes `result.json`, a failing rank its `rank<N>.json`."""
    device = pick_device(spec.local_rank)
    out = Path(out_dir)
    apply_memory_limit(cell.mem_limit_mb, device)
    try:
        times, peaks = _measure(spec, cell, warmup, steps, device)
    except Exception as exc:
        status = "oom" if is_oom_error(exc) else "error"
        reason = oom_reason(exc, device) if status == "oom" else f"{type(exc).__name__}: {exc}".splitlines()[0]
        lift_memory_limit(device)  # so that writing this report and the launcher's one cannot fail in turn
        (out / f"rank{spec.rank}.json").write_text(json.dumps({"status": status, "reason": reason}))
        raise
    if spec.rank == 0:
        (out / "result.json").write_text(json.dumps({"step_times_s": times, "peak_mem_mb_per_stage": peaks}))


def _measure(spec: RankSpec, cell: Cell, warmup: int, steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    preset = PRESETS[cell.preset]
    session = open_session(spec, TransformerClassifier(preset), parallel_config(cell), seed=0)
    try:
        engine = session.engine
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        local = cell.batch_size // cell.dp
        gen = torch.Generator().manual_seed(spec.rank // cell.pp)
        x = torch.randint(2, preset.vocab_size, (local, preset.seq_len), generator=gen)
        y = torch.randint(0, preset.num_classes, (local,), generator=gen)
        reset_peak_memory(device)
        times = []
        for index in range(warmup + steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            engine.step(x, y)  # ends with a collective over the whole job: every rank has finished
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index >= warmup:
                times.append(time.perf_counter() - start)
        peaks: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_memory_mb(device))
        per_stage = [max(peaks[r] for r in range(pp_rank, len(peaks), cell.pp)) for pp_rank in range(cell.pp)]
        return times, per_stage
    finally:
        close_session()
