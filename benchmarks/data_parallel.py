"""Benchmark: data-parallel throughput of dp=2 against dp=1 on 2 CPU ranks, for DDP and FSDP2 (pp=1).

The reference workload (`--preset`, default `cpu`) with a global batch of `--batch-size` (default 64)
synthetic IMDB reviews: dp=1 trains on all of it on one rank, dp=2 on half of it per rank. Configurations:

- `dp1`: pipetrain's engine (pp=1) on rank 0 alone, over a process group of rank 0 only
  (`new_group([0])`), while rank 1 sleeps at a barrier: one busy core, as in a 1-process job. At dp=1
  pipetrain wraps nothing (no DDP or FSDP), so this one configuration is the baseline of both modes.
- `ddp dp2`, `fsdp dp2`: `pipetrain.session.build_session` with dp=2, pp=1 over both ranks.

Running dp=1 inside the 2-rank job, rather than in a job of its own, lets all three configurations be
timed in interleaved rounds (see `interleave.py`), so machine noise hits them alike; a separate
1-rank job would run the very same code on one process. Every step is zero_grad + engine.step (which
ends with a loss/accuracy all-reduce over the configuration's group) + AdamW step, timed on rank 0.
Run: `.venv/bin/python benchmarks/data_parallel.py [--quick] [--json PATH]`.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from interleave import (
    CPU_NOTE, Step, add_common_args, cpu_cell, cpu_per_rank, cpu_per_step, engine_step, finish, markdown_table,
    median_s, paired_ratio, reference_batch, resolve_defaults, run_job,
)
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.ranks import RankSpec
from pipetrain.pipeline import PipelineEngine
from pipetrain.session import build_session
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

WORLD = 2
SEED = 0
LR = 1e-4
MODES = ("ddp", "fsdp")
BASELINE = "dp1"
FULL = {"rounds": 15, "steps": 4, "warmup": 2}
QUICK = {"rounds": 3, "steps": 2, "warmup": 1}
TARGETS = {"ddp": 1.7}


def config_names() -> list[str]:
    return [BASELINE, *(f"{mode} dp{WORLD}" for mode in MODES)]


def single_rank_step(model: TransformerClassifier, args: argparse.Namespace, device: torch.device,
                     rank: int) -> Step:
    """dp=1 on rank 0 over a group of its own; None on the other ranks (which still join the new group)."""
    solo = dist.new_group([0])
    if rank != 0:
        return None
    engine = PipelineEngine(model, PipelineConfig(pp=1), device=device, pp_group=solo, metrics_group=solo, seed=SEED)
    return engine_step(engine, *reference_batch(args.preset, args.batch_size), lr=LR)


def data_parallel_step(model: TransformerClassifier, mode: str, args: argparse.Namespace,
                       device: torch.device) -> Step:
    """dp=2 over both ranks; each trains on its half of the global batch."""
    session = build_session(model, ParallelConfig(dp=WORLD, dp_mode=mode), device, seed=SEED)
    share = reference_batch(args.preset, args.batch_size, replica=session.mesh.dp_rank, replicas=WORLD)
    return engine_step(session.engine, *share, lr=LR)


def measure(spec: RankSpec, device: torch.device, args: argparse.Namespace) -> dict[str, Step]:
    model = TransformerClassifier(PRESETS[args.preset])
    steps = {BASELINE: single_rank_step(model, args, device, spec.rank)}
    for mode in MODES:
        steps[f"{mode} dp{WORLD}"] = data_parallel_step(model, mode, args, device)
    return steps


# ---- report ---------------------------------------------------------------------------------------------


def summarize(report: dict, batch_size: int) -> list[dict]:
    """One record per configuration: median step, global samples/s and speed-ups over dp=1.

    `speedup_vs_dp1` is paired (median over rounds of the per-round ratio), so that a change of machine
    load during the run, which shifts whole rounds, cancels; the ratio of the medians is kept beside it.
    """
    times = report["times_s"]
    base, base_cpu = median_s(times[BASELINE]), cpu_per_step(report, BASELINE)
    records = []
    for name in config_names():
        t = median_s(times[name])
        records.append({
            "name": name, "median_step_s": t, "samples_per_s": batch_size / t,
            "cpu_step_s": cpu_per_step(report, name),
            "speedup_vs_dp1": paired_ratio(times[BASELINE], times[name]),
            "speedup_vs_dp1_of_medians": base / t,
            "cpu_bound_speedup": base_cpu / max(cpu_per_rank(report, name)),
        })
    return records


def _verdict(mode: str, speedup: float) -> str:
    target = TARGETS.get(mode)
    if target is None:
        return "(no target)"
    return f"(target >= {target}x: {'ok' if speedup >= target else 'BELOW TARGET'})"


def _row(r: dict, batch_size: int) -> list:
    base = r["name"] == BASELINE
    return [r["name"], batch_size if base else batch_size // WORLD, f"{r['median_step_s'] * 1e3:.1f}",
            f"{r['samples_per_s']:.1f}", cpu_cell(r["cpu_step_s"], r["median_step_s"]),
            "-" if base else f"{r['speedup_vs_dp1']:.2f}x ({r['speedup_vs_dp1_of_medians']:.2f}x)",
            "-" if base else f"{r['cpu_bound_speedup']:.2f}x"]


def render(records: list[dict], args: argparse.Namespace) -> str:
    headers = ["config", "per-rank batch", "median step (ms)", "samples/s (global)", "CPU/step (ms)",
               "dp2 / dp1 (of medians)", "CPU-bound dp2 / dp1"]
    ratios = [f"- {r['name'].split()[0]}: dp{WORLD}/dp1 throughput {r['speedup_vs_dp1']:.2f}x "
              f"{_verdict(r['name'].split()[0], r['speedup_vs_dp1'])}; CPU-bound {r['cpu_bound_speedup']:.2f}x"
              for r in records if r["name"] != BASELINE]
    return "\n".join([
        f"## Data parallelism: preset {args.preset}, global batch {args.batch_size}, pp=1, gloo, 1 thread/rank; "
        f"{args.rounds} rounds x {args.steps} timed steps per configuration",
        "",
        markdown_table(headers, [_row(r, args.batch_size) for r in records]),
        "",
        "Step = zero_grad + engine.step (forward/backward, gradient all-reduce or reduce-scatter, metrics "
        "all-reduce) + AdamW step, timed on rank 0. dp2/dp1 is the throughput ratio at the same global batch, "
        "paired: the median over rounds of the ratio of the two configurations' median step times in that "
        "round, so that load changes during the run cancel (in brackets: the ratio of the overall medians).",
        CPU_NOTE,
        "CPU-bound dp2/dp1 = dp1's CPU per step / the busiest dp2 rank's: the speed-up if every rank had a "
        "core to itself and never waited (roughly what the wall-clock ratio reaches on an idle machine).",
        "",
        "### Throughput ratios",
        *ratios,
    ])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    args = parser.parse_args()
    resolve_defaults(args, full=FULL, quick=QUICK)
    if args.batch_size % WORLD:
        parser.error(f"--batch-size must be a multiple of {WORLD}")
    return args


def main() -> None:
    args = parse_args()
    report = run_job(measure, args, world_size=WORLD)
    report["configs"] = summarize(report, args.batch_size)
    finish(report, render(report["configs"], args), args.json)


if __name__ == "__main__":
    main()
