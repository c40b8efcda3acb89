"""Benchmark: pipetrain's pipeline engine against hand-written torch.distributed.pipelining and one process.

On 2 CPU ranks (gloo, one thread each), the reference Transformer (`--preset`, default `cpu`) split
uniformly into 2 stages, one batch of synthetic IMDB reviews (`--batch-size`, default 64) reused every
step. Configurations:

- `single`: the whole model in one process, no pipeline. It runs on rank 0 while rank 1 sleeps at a
  barrier, so it uses one core like a plain training loop, and sees the same machine as the others.
- `pipetrain <schedule> x<chunks>`: `pipetrain.session.build_session` + `PipelineEngine.step`
  (`gpipe x1` is naive model parallelism).
- `torch <schedule> x<chunks>`: `PipelineStage` + `ScheduleGPipe`/`Schedule1F1B` written by hand on the
  default process group, with the same blocks and weights (`pipetrain.blocks.build_blocks`).

Every step is zero_grad + forward/backward + AdamW step and returns the loss, as a user's loop would:
pipetrain's `engine.step` also all-reduces loss/accuracy (4 doubles) over the job so every rank gets them;
the torch loop returns the mean of the micro-batch losses on the last stage only (`.item()`).
Times are rank 0's (it holds the first stage, whose step spans the whole pipeline: first forward to
last backward). All configurations are built in one spawned job and timed in interleaved rounds
(see `interleave.py`). Run: `.venv/bin/python benchmarks/pipeline_overhead.py [--quick] [--json PATH]`.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from interleave import (
    CPU_NOTE, Step, add_common_args, cpu_cell, cpu_per_step, engine_step, finish, markdown_table, median_s,
    paired_ratio, reference_batch, resolve_defaults, run_job,
)
from pipetrain.bench.results import ideal_speedup
from pipetrain.blocks import build_blocks, build_sequential
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.ranks import RankSpec
from pipetrain.partition import balance_bounds, uniform_balance
from pipetrain.session import build_session
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

PP = 2
SEED = 0
LR = 1e-4
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
FULL = {"rounds": 8, "steps": 3, "warmup": 2, "chunks": [1, 2, 4, 8]}
QUICK = {"rounds": 2, "steps": 2, "warmup": 1, "chunks": [1, 4]}
OVERHEAD_TARGET = 1.05
SPEEDUP_TARGET = 1.5


class Config(NamedTuple):
    """One timed configuration: `impl` is single, pipetrain or torch."""

    impl: str
    schedule: str = "-"
    chunks: int = 1

    @property
    def name(self) -> str:
        return "single" if self.impl == "single" else f"{self.impl} {self.schedule} x{self.chunks}"


def configs(chunks: list[int]) -> list[Config]:
    """All configurations; each pipetrain one is followed by its torch twin (neighbours in every round)."""
    out = [Config("single")]
    for count in chunks:
        for schedule in TORCH_SCHEDULES:
            if schedule == "1f1b" and count < PP:  # Schedule1F1B needs chunks >= stages
                continue
            out += [Config("pipetrain", schedule, count), Config("torch", schedule, count)]
    return out


def single_step(model: TransformerClassifier, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Step:
    net = build_sequential(model, seed=SEED, device=device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def pipetrain_step(model: TransformerClassifier, config: Config, x: torch.Tensor, y: torch.Tensor,
                   device: torch.device) -> Step:
    pipeline = PipelineConfig(pp=PP, schedule=config.schedule, n_microbatches=config.chunks)
    session = build_session(model, ParallelConfig(pipeline=pipeline), device, seed=SEED)
    return engine_step(session.engine, x, y, lr=LR)


def torch_step(model: TransformerClassifier, config: Config, x: torch.Tensor, y: torch.Tensor,
               device: torch.device, rank: int) -> Step:
    start, stop = balance_bounds(uniform_balance(model.num_blocks, PP))[rank]
    module = nn.Sequential(*build_blocks(model, range(start, stop), seed=SEED, device=device))
    stage = PipelineStage(module, rank, PP, device)  # shapes inferred on the first (warm-up) step
    schedule = TORCH_SCHEDULES[config.schedule](stage, n_microbatches=config.chunks, loss_fn=F.cross_entropy)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)

    def step() -> float | None:
        optimizer.zero_grad(set_to_none=True)
        if stage.is_first:
            schedule.step(x)
            loss = None
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            loss = torch.stack(losses).mean().item()
        optimizer.step()
        return loss

    return step


def measure(spec: RankSpec, device: torch.device, args: argparse.Namespace) -> dict[str, Step]:
    """This rank's step of every configuration (the single-process one runs on rank 0 only)."""
    model = TransformerClassifier(PRESETS[args.preset])
    x, y = reference_batch(args.preset, args.batch_size)  # the same batch on both ranks
    steps: dict[str, Step] = {}
    for config in configs(args.chunks):
        if config.impl == "single":
            steps[config.name] = single_step(model, x, y, device) if spec.rank == 0 else None
        elif config.impl == "pipetrain":
            steps[config.name] = pipetrain_step(model, config, x, y, device)
        else:
            steps[config.name] = torch_step(model, config, x, y, device, spec.rank)
    return steps


# ---- report ---------------------------------------------------------------------------------------------


def summarize(report: dict, chunks: list[int], batch_size: int) -> list[dict]:
    """One record per configuration: median step, throughput and the ratios that concern it.

    Ratios are paired (median over rounds of the per-round ratio), so that a change of machine load during
    the run, which shifts whole rounds, cancels; `pipetrain_over_torch_of_medians` is kept for comparison.
    """
    times = report["times_s"]

    def ratio(numerator: str, denominator: str) -> float:
        return paired_ratio(times[numerator], times[denominator])

    records = []
    for config in configs(chunks):
        name, t = config.name, median_s(times[config.name])
        naive = Config(config.impl, "gpipe", 1).name
        twin = Config("torch", config.schedule, config.chunks).name
        pipelined, pipetrain = config.impl != "single", config.impl == "pipetrain"
        records.append({
            "name": name, "impl": config.impl, "schedule": config.schedule, "chunks": config.chunks,
            "median_step_s": t, "samples_per_s": batch_size / t, "cpu_step_s": cpu_per_step(report, name),
            "speedup_vs_single": ratio("single", name),
            "speedup_vs_chunks1": ratio(naive, name) if pipelined else None,
            "ideal_speedup_vs_chunks1": ideal_speedup(PP, config.chunks, config.schedule) if pipelined else None,
            "pipetrain_over_torch": ratio(name, twin) if pipetrain else None,
            "pipetrain_over_torch_of_medians": t / median_s(times[twin]) if pipetrain else None,
            "pipetrain_over_torch_cpu": cpu_per_step(report, name) / cpu_per_step(report, twin) if pipetrain else None,
        })
    return records


def _row(r: dict) -> list[str]:
    pipelined = r["impl"] != "single"
    return [r["name"], f"{r['median_step_s'] * 1e3:.1f}", f"{r['samples_per_s']:.1f}",
            cpu_cell(r["cpu_step_s"], r["median_step_s"]), f"{r['speedup_vs_single']:.2f}x",
            f"{r['speedup_vs_chunks1']:.2f}x ({r['ideal_speedup_vs_chunks1']:.2f}x)" if pipelined else "-",
            "-" if r["pipetrain_over_torch"] is None else f"{r['pipetrain_over_torch']:.3f}"]


def _overhead_line(r: dict) -> str:
    verdict = "ok" if r["pipetrain_over_torch"] <= OVERHEAD_TARGET else "ABOVE TARGET"
    return (f"- {r['name']} / torch: {r['pipetrain_over_torch']:.3f} {verdict} (ratio of medians "
            f"{r['pipetrain_over_torch_of_medians']:.3f}; CPU per step {r['pipetrain_over_torch_cpu']:.3f})")


def _speedup_line(r: dict, by_name: dict[str, dict]) -> str:
    verdict = "ok" if r["speedup_vs_chunks1"] >= SPEEDUP_TARGET else "BELOW TARGET"
    torch_twin = by_name[Config("torch", r["schedule"], r["chunks"]).name]
    return (f"- {r['name']}: {r['speedup_vs_chunks1']:.2f}x {verdict} (ideal {r['ideal_speedup_vs_chunks1']:.2f}x, "
            f"raw torch {torch_twin['speedup_vs_chunks1']:.2f}x)")


def render(records: list[dict], args: argparse.Namespace) -> str:
    headers = ["config", "median step (ms)", "samples/s", "CPU/step (ms)", "vs single", "vs chunks 1 (ideal)",
               "pipetrain / torch"]
    by_name = {r["name"]: r for r in records}
    pipetrain = [r for r in records if r["impl"] == "pipetrain"]
    speedups = [_speedup_line(r, by_name) for r in pipetrain if r["chunks"] >= 4]
    return "\n".join([
        f"## Pipeline overhead: preset {args.preset}, batch {args.batch_size}, pp={PP} (uniform split), gloo, "
        f"1 thread/rank; {args.rounds} rounds x {args.steps} timed steps per configuration",
        "",
        markdown_table(headers, [_row(r) for r in records]),
        "",
        "Step = zero_grad + forward/backward + AdamW step, timed on rank 0. `vs` columns are speed-ups (>1 is "
        "faster; `vs chunks 1` is against the same implementation's naive gpipe x1), pipetrain/torch a "
        "slow-down (>1 is slower). Both are paired: the median over rounds of the ratio of the two "
        "configurations' medians in that round, so that load changes during the run cancel.",
        CPU_NOTE,
        "Per step, pipetrain's engine.step also all-reduces loss/accuracy over the job (every rank gets them); "
        "the hand-written torch loop returns the mean micro-batch loss on the last stage only.",
        "",
        f"### pipetrain / raw torch, same schedule and chunks (target <= {OVERHEAD_TARGET})",
        *map(_overhead_line, pipetrain),
        "",
        f"### pipetrain speed-up of chunks >= 4 over chunks 1 (target >= {SPEEDUP_TARGET}x)",
        *(speedups or ["- (no configuration with chunks >= 4)"]),
    ])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--chunks", type=int, nargs="+", help="micro-batch counts (default 1 2 4 8; quick 1 4)")
    args = parser.parse_args()
    resolve_defaults(args, full=FULL, quick=QUICK)
    if 1 not in args.chunks:
        args.chunks = [1, *args.chunks]  # chunks 1 is the naive baseline of the speed-ups
    if any(args.batch_size % chunks for chunks in args.chunks):
        parser.error(f"--batch-size {args.batch_size} must be a multiple of every --chunks value (torch's "
                     "schedules need equal micro-batches)")
    return args


def main() -> None:
    args = parse_args()
    report = run_job(measure, args, world_size=PP)
    report["configs"] = summarize(report, args.chunks, args.batch_size)
    finish(report, render(report["configs"], args), args.json)


if __name__ == "__main__":
    main()
