"""Benchmark: fp32 against bf16 autocast (`--precision bf16`): step time and peak step memory, side by side.

On 2 CPU ranks (gloo, one thread each), the reference Transformer (`--preset`, default `cpu`) pipelined
over pp=2 (1F1B, `--chunks`, default 4), one batch of synthetic IMDB reviews (`--batch-size`, default 64)
reused every step; plus the same model in one process (rank 0 while rank 1 waits) in fp32 and in bf16,
which shows what bf16 kernels alone give on this CPU. A step is zero_grad + forward/backward + AdamW.

Memory: for each configuration, one step is run with `torch.autograd.graph.saved_tensors_hooks` counting
the bytes of every tensor autograd saves for the backward (each storage once, the parameters themselves
excluded): the activations of the step summed over its micro-batches (GPipe holds all of them at its peak,
1F1B at most pp), plus, in bf16, autocast's bf16 copies of the weights; the larger rank's figure.
Weights, gradients and AdamW state are fp32 in both precisions and are not counted.
(The process's resident size is no use here: glibc keeps freed memory resident, so a step reuses it.)
Run: `.venv/bin/python benchmarks/precision.py [--quick] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from interleave import (
    CPU_NOTE, Step, add_common_args, cpu_cell, cpu_per_step, finish, markdown_table, median_s, paired_ratio,
    reference_batch, resolve_defaults, run_job, engine_step,
)
from pipetrain.blocks import build_sequential
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.ranks import RankSpec
from pipetrain.pipeline.precision import autocast
from pipetrain.session import build_session
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

PP = 2
SEED = 0
LR = 1e-4
FULL = {"rounds": 6, "steps": 3, "warmup": 2, "chunks": 4}
QUICK = {"rounds": 2, "steps": 2, "warmup": 1, "chunks": 4}
CONFIGS = ("single fp32", "single bf16", "pp2 fp32", "pp2 bf16")


def single_step(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str) -> Step:
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast("cpu", precision):
            out = net(x)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _step_memory_mb(step: Step, parameters: list[torch.nn.Parameter]) -> float | None:
    """MB of the tensors one step saves for its backward, each storage once, the parameters themselves not
    counted (None: not run on this rank)."""
    dist.barrier()
    if step is None:
        return None
    weights = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(seen.values()) / 2**20


def measure(spec: RankSpec, device: torch.device, args: argparse.Namespace) -> dict[str, Step]:
    model = TransformerClassifier(PRESETS[args.preset])
    x, y = reference_batch(args.preset, args.batch_size)
    steps: dict[str, Step] = {}
    parameters: dict[str, list[torch.nn.Parameter]] = {}
    for name in CONFIGS:
        layout, precision = name.split()
        if layout == "single":
            net = build_sequential(model, seed=SEED)
            steps[name] = single_step(net, x, y, precision) if spec.rank == 0 else None
            parameters[name] = list(net.parameters())
        else:
            pipeline = PipelineConfig(pp=PP, schedule="1f1b", n_microbatches=args.chunks)
            session = build_session(model, ParallelConfig(pipeline=pipeline), device, seed=SEED, precision=precision)
            steps[name] = engine_step(session.engine, x, y, lr=LR)
            parameters[name] = list(session.engine.parameters())
    memory = {name: _step_memory_mb(step, parameters[name]) for name, step in steps.items()}
    (Path(args.memory_dir) / f"rank{spec.rank}.json").write_text(json.dumps(memory))
    return steps


def summarize(report: dict, memory: list[dict], batch_size: int) -> list[dict]:
    times = report["times_s"]
    records = []
    for name in CONFIGS:
        layout, precision = name.split()
        fp32 = f"{layout} fp32"
        step_mb = [m[name] for m in memory if m[name] is not None]  # the larger rank's
        records.append({
            "name": name, "median_step_s": median_s(times[name]), "cpu_step_s": cpu_per_step(report, name),
            "samples_per_s": batch_size / median_s(times[name]),
            "speedup_vs_fp32": paired_ratio(times[fp32], times[name]),
            "step_memory_mb": max(step_mb) if step_mb else None,
        })
    for record in records:
        fp32 = next(r for r in records if r["name"] == record["name"].split()[0] + " fp32")
        mine, base = record["step_memory_mb"], fp32["step_memory_mb"]
        record["memory_vs_fp32"] = mine / base if mine is not None and base else None
    return records


def render(records: list[dict], args: argparse.Namespace) -> str:
    headers = ["config", "median step (ms)", "samples/s", "CPU/step (ms)", "speed-up vs fp32",
               "saved for backward (MB)", "vs fp32"]
    rows = [[r["name"], f"{r['median_step_s'] * 1e3:.1f}", f"{r['samples_per_s']:.1f}",
             cpu_cell(r["cpu_step_s"], r["median_step_s"]), f"{r['speedup_vs_fp32']:.2f}x",
             "-" if r["step_memory_mb"] is None else f"{r['step_memory_mb']:.1f}",
             "-" if r["memory_vs_fp32"] is None else f"{r['memory_vs_fp32']:.2f}"] for r in records]
    return "\n".join([
        f"## Precision: preset {args.preset}, batch {args.batch_size}, pp={PP} (1f1b x{args.chunks}) and one "
        f"process, gloo, 1 thread/rank; {args.rounds} rounds x {args.steps} timed steps per configuration",
        "",
        markdown_table(headers, rows),
        "",
        "speed-up vs fp32: paired (median over rounds of the per-round ratio fp32 / bf16 of the same layout; "
        ">1 means bf16 is faster). saved for backward: bytes of the tensors one step saves for its backward "
        "(activations, all micro-batches), the larger rank's; weights, gradients and AdamW state are fp32 in both.",
        CPU_NOTE,
    ])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--chunks", type=int, help="micro-batches of the pp=2 runs (default 4)")
    args = parser.parse_args()
    resolve_defaults(args, full=FULL, quick=QUICK)
    if args.batch_size % args.chunks:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of --chunks {args.chunks}")
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="pipetrain-precision-") as folder:
        args.memory_dir = folder
        report = run_job(measure, args, world_size=PP)
        memory = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(PP)]
    report["memory_mb"] = memory
    report["configs"] = summarize(report, memory, args.batch_size)
    finish(report, render(report["configs"], args), args.json)


if __name__ == "__main__":
    main()
