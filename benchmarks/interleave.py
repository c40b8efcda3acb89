"""Interleaved measurement shared by the benchmark scripts: one spawned job, rounds over configurations, medians.

Absolute times are unstable on a shared 2-core machine, so the scripts never compare runs made minutes
apart. One job of spawned ranks builds every configuration once, then times them in rounds: each round
visits every configuration (in an order rotated by one per round, so none always runs first or last),
and each visit is one untimed step, to re-warm caches after the previous configuration, then `steps`
timed steps. Machine noise thus hits all configurations alike; ratios are taken per round (`paired_ratio`),
so that a change of load during the run, which shifts whole rounds, cancels too.
A configuration may run on some ranks only (its step is None elsewhere): those ranks wait at the barrier
that starts every visit. Every step trains on one fixed batch of the reference workload's synthetic IMDB data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.bench.report import collect_environment
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.pipeline import PipelineEngine
from pipetrain.session import close_session, join_job
from pipetrain.workloads.classifier.imdb import batches, synthetic_imdb
from pipetrain.workloads.classifier.model import PRESETS

__all__ = [
    "Step", "add_common_args", "resolve_defaults", "reference_batch", "engine_step", "run_job", "time_rounds",
    "cpu_per_rank", "cpu_per_step", "CPU_NOTE", "cpu_cell", "median_s", "round_medians", "paired_ratio",
    "markdown_table", "finish",
]

#: Times of each configuration's steps: name -> one list of step times per round.
Rounds = dict[str, list[list[float]]]
#: One training step of a configuration on this rank (None: the configuration does not run here).
Step = Callable[[], object] | None
#: `measure(spec, device, args)` builds this rank's steps (configuration name -> step) once the job is joined.
Measure = Callable[[RankSpec, torch.device, argparse.Namespace], dict[str, Step]]


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every benchmark script has; None defaults are filled by `resolve_defaults`."""
    parser.add_argument("--preset", default="cpu", help="reference Transformer preset (default: cpu)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (default: 64)")
    parser.add_argument("--rounds", type=int, help="rounds over all configurations")
    parser.add_argument("--steps", type=int, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, help="untimed steps per configuration before the first round")
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke run instead of the full defaults")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also save the raw times and ratios as JSON")


def resolve_defaults(args: argparse.Namespace, *, full: Mapping[str, Any], quick: Mapping[str, Any]) -> None:
    """Fill every flag left at None from the `quick` or `full` defaults."""
    chosen = quick if args.quick else full
    for key, value in chosen.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def reference_batch(preset: str, batch_size: int, *, replica: int = 0, replicas: int = 1,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s share of the first global batch of synthetic IMDB reviews for `preset` (tokens, labels)."""
    config = PRESETS[preset]
    train, _ = synthetic_imdb(num_train=batch_size, num_test=1, seq_len=config.seq_len,
                              vocab_size=config.vocab_size, seed=seed)
    return next(batches(train, batch_size, shuffle=False, seed=seed, epoch=0, replica=replica, replicas=replicas))


def engine_step(engine: PipelineEngine, x: torch.Tensor, y: torch.Tensor, *, lr: float = 1e-4) -> Step:
    """A pipetrain training step on one fixed batch: zero_grad, `engine.step` (returns the loss), AdamW step."""
    optimizer = torch.optim.AdamW(engine.parameters(), lr=lr)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = engine.step(x, y).loss
        optimizer.step()
        return loss

    return step


def _rank_main(spec: RankSpec, measure: Measure, args: argparse.Namespace, out_dir: str) -> None:
    device = join_job(spec)  # gloo, torch.set_num_threads(1)
    try:
        steps = measure(spec, device, args)
        timings = time_rounds(steps, rounds=args.rounds, per_visit=args.steps, warmup=args.warmup)
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, timings)
        if spec.rank == 0:
            (Path(out_dir) / "timings.json").write_text(json.dumps(per_rank))
    finally:
        close_session()


def run_job(measure: Measure, args: argparse.Namespace, *, world_size: int) -> dict[str, Any]:
    """Spawn `world_size` ranks once and time `measure`'s steps on them; every rank's times plus machine context.

    `times_s` holds rank 0's wall-clock step times (the ones compared), `ranks` every rank's wall and CPU times.
    """
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipetrain-benchmark-") as work:
        spawn(_rank_main, ranks=range(world_size), world_size=world_size, master_addr="127.0.0.1",
              master_port=free_port(), args=(measure, args, work), timeout_s=3600)
        per_rank = json.loads((Path(work) / "timings.json").read_text())
    return {
        "environment": collect_environment(sys.argv, device="cpu"),
        "args": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "wall_s": time.perf_counter() - started,
        "load_avg_before": list(load_before),
        "load_avg_after": list(os.getloadavg()),
        "times_s": per_rank[0]["wall_s"],
        "ranks": per_rank,
    }


def _visit(step: Step, steps: int) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU (this process, all threads) seconds of `steps` timed steps after one untimed one."""
    if step is None:
        return [], []
    step()  # re-warm after the previous configuration; not timed
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


def time_rounds(steps: Mapping[str, Step], *, rounds: int, per_visit: int, warmup: int) -> dict[str, Rounds]:
    """This rank's step times: {"wall_s": name -> one list per round, "cpu_s": the same in CPU seconds}.

    Every rank must call it with the same names in the same order.
    """
    names = list(steps)
    for name in names:
        dist.barrier()
        for _ in range(warmup if steps[name] is not None else 0):
            steps[name]()
    timings: dict[str, Rounds] = {"wall_s": {name: [] for name in names}, "cpu_s": {name: [] for name in names}}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            walls, cpus = _visit(steps[name], per_visit)
            timings["wall_s"][name].append(walls)
            timings["cpu_s"][name].append(cpus)
    dist.barrier()
    return timings


def cpu_per_rank(report: Mapping[str, Any], name: str) -> list[float]:
    """Median CPU seconds of one step of configuration `name` on each rank it runs on."""
    return [median_s(rank["cpu_s"][name]) for rank in report["ranks"] if any(rank["cpu_s"][name])]


def cpu_per_step(report: Mapping[str, Any], name: str) -> float:
    """CPU seconds one step of configuration `name` costs, summed over the ranks it runs on: the work done."""
    return sum(cpu_per_rank(report, name))


def median_s(rounds: Sequence[Sequence[float]]) -> float:
    """Median of all timed steps of a configuration."""
    return statistics.median(t for visit in rounds for t in visit)


def round_medians(rounds: Sequence[Sequence[float]]) -> list[float]:
    """Median step time of each round (visit) of a configuration."""
    return [statistics.median(visit) for visit in rounds]


def paired_ratio(numerator: Sequence[Sequence[float]], denominator: Sequence[Sequence[float]]) -> float:
    """Median over rounds of the ratio of the two configurations' medians in that round (neighbours in time)."""
    return statistics.median(a / b for a, b in zip(round_medians(numerator), round_medians(denominator)))


#: What the CPU column of both scripts' tables means.
CPU_NOTE = (
    "CPU/step is the CPU time of one step summed over the ranks that run it (median per rank): the work done, "
    "which machine load disturbs far less than wall time; `cores` = CPU/step / median step time, how many "
    "cores the configuration kept busy on average (1.0: its ranks never computed at the same time)."
)


def cpu_cell(cpu_s: float, wall_s: float) -> str:
    """The CPU column: milliseconds of CPU per step and the cores kept busy."""
    return f"{cpu_s * 1e3:.0f} ({cpu_s / wall_s:.2f} cores)"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are printed as given (format them before)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def finish(report: dict[str, Any], text: str, json_path: Path | None) -> None:
    """Print the report text (with the machine load seen around the run) and save the JSON if asked."""
    before = ", ".join(f"{x:.2f}" for x in report["load_avg_before"])
    after = ", ".join(f"{x:.2f}" for x in report["load_avg_after"])
    cpus = report["environment"]["usable_cpus"]
    print(text)
    print(f"\nmachine: {cpus} usable CPUs; load average (1, 5, 15 min) {before} before, {after} after; "
          f"whole run {report['wall_s']:.0f} s")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1))
        print(f"raw numbers saved to {json_path}")
