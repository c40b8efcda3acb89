"""Benchmark: what `--trace` costs per step (target: under 5% of the step time).

On 2 CPU ranks (gloo, one thread each), the reference Transformer (`--preset`, default `cpu`) split
uniformly into 2 stages, 1F1B with `--chunks` micro-batches (default 4 and 16: more micro-batches, more
spans per step), one batch of synthetic IMDB reviews (`--batch-size`, default 64) reused every step.
For each chunk count, `untraced` is a plain step (the tracer's hooks absent: what every run without
`--trace` does) and `traced` the same step on the same engine inside `Tracer.step()` recording every
forward, backward, wait, optimizer step and metrics all-reduce. Both are timed in interleaved rounds in
one spawned job (see `interleave.py`); the overhead is the paired ratio traced / untraced of rank 0's
step times. Run: `.venv/bin/python benchmarks/trace_overhead.py [--quick] [--json PATH]`.
"""

from __future__ import annotations

import argparse

import torch

from interleave import (
    add_common_args, finish, markdown_table, median_s, paired_ratio, reference_batch, resolve_defaults, run_job,
)
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.ranks import RankSpec
from pipetrain.session import build_session
from pipetrain.trace.tracer import Tracer
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

FULL = {"rounds": 8, "steps": 3, "warmup": 2, "chunks": [4, 16]}
QUICK = {"rounds": 2, "steps": 2, "warmup": 1, "chunks": [4]}
OVERHEAD_TARGET = 1.05


def measure(spec: RankSpec, device: torch.device, args: argparse.Namespace) -> dict:
    x, y = reference_batch(args.preset, args.batch_size)
    steps = {}
    for chunks in args.chunks:
        parallel = ParallelConfig(pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=chunks))
        engine = build_session(TransformerClassifier(PRESETS[args.preset]), parallel, device, seed=0).engine
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        tracer = Tracer(engine, None, steps=10**9, warmup=0)  # records every step it wraps, writes nothing

        def plain(engine=engine, optimizer=optimizer) -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = engine.step(x, y).loss
            optimizer.step()
            return loss

        def traced(engine=engine, optimizer=optimizer, tracer=tracer) -> float:
            with tracer.step():
                optimizer.zero_grad(set_to_none=True)
                loss = engine.step(x, y).loss
                with tracer.span("optimizer"):
                    optimizer.step()
            return loss

        steps[f"untraced x{chunks}"] = plain
        steps[f"traced x{chunks}"] = traced
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--chunks", type=int, nargs="+", help="micro-batch counts (default: 4 16)")
    args = parser.parse_args()
    resolve_defaults(args, full=FULL, quick=QUICK)
    report = run_job(measure, args, world_size=2)
    times = report["times_s"]
    rows, worst = [], 0.0
    for chunks in args.chunks:
        ratio = paired_ratio(times[f"traced x{chunks}"], times[f"untraced x{chunks}"])
        worst = max(worst, ratio)
        rows.append([chunks, f"{median_s(times[f'untraced x{chunks}']) * 1e3:.1f}",
                     f"{median_s(times[f'traced x{chunks}']) * 1e3:.1f}", f"{100 * (ratio - 1):+.1f}%"])
    text = [f"preset {args.preset}, pp=2, 1f1b, batch {args.batch_size}; rank 0's step times",
            "", markdown_table(["chunks", "untraced (ms)", "traced (ms)", "tracing overhead (paired)"], rows), "",
            f"largest overhead {100 * (worst - 1):+.1f}% (target < {100 * (OVERHEAD_TARGET - 1):.0f}%)"]
    finish(report, "\n".join(text), args.json)


if __name__ == "__main__":
    main()
