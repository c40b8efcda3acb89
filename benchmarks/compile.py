"""Benchmark: `--compile` (each block compiled with torch.compile, inductor) against eager stages, at pp=2 on CPU.

On 2 CPU ranks (gloo, one thread each), 1F1B with `--chunks` micro-batches (default 4) of one fixed batch
(`--batch-size`, default 32): the reference classifier (`--preset`, default `cpu`, synthetic IMDB reviews of the
preset's length) and the `lm` workload's decoder (`--lm-preset`, default `cpu`, random tokens of its window, the
token cross-entropy). Configurations, per model: `eager`, `compiled` (torch's automatic dynamic shapes: static
here), and for the classifier `compiled dynamic` (`dynamic=True`, what `--bucket` jobs use: every dimension
symbolic). Each step is zero_grad + `engine.step` + AdamW, as `pipetrain train` runs it.

Compile time is reported apart: the first step of each configuration, timed on its own on each rank right
after it is built (compilation happens in the first calls), minus the eager configuration's first step.
inductor's on-disk caches are on by default: a second run of this script finds the kernels built (much shorter
"first step"); pass `--cold` to give it a fresh cache folder. Steady steps are then timed in interleaved rounds
(see `interleave.py`): ratios are eager / compiled per round (above 1: compiled is faster).
Run: `.venv/bin/python benchmarks/compile.py [--quick] [--cold] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from interleave import (
    Step, add_common_args, engine_step, finish, markdown_table, median_s, paired_ratio, reference_batch,
    resolve_defaults, run_job,
)
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.ranks import RankSpec
from pipetrain.session import build_session
from pipetrain.workloads.registry import get_workload
from pipetrain.workloads.classifier.model import PRESETS, TransformerClassifier

PP = 2
SEED = 0
FULL = {"rounds": 5, "steps": 3, "warmup": 2}
QUICK = {"rounds": 2, "steps": 2, "warmup": 1}
TARGET = 1.2
#: name -> (model, compile, compile_dynamic)
CONFIGS = {
    "classifier eager": ("classifier", False, None),
    "classifier compiled": ("classifier", True, None),
    "classifier compiled dynamic": ("classifier", True, True),
    "lm eager": ("lm", False, None),
    "lm compiled": ("lm", True, None),
}


def _lm_batch(preset: str, batch_size: int) -> tuple[object, tuple[torch.Tensor, torch.Tensor]]:
    workload = get_workload("lm")
    model = workload.model(preset)
    gen = torch.Generator().manual_seed(SEED)
    vocab, length = model.config.vocab_size, model.config.seq_len
    tokens = torch.randint(1, vocab, (batch_size, length + 1), generator=gen)
    return (model, workload.loss()), (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def measure(spec: RankSpec, device: torch.device, args: argparse.Namespace) -> dict[str, Step]:
    """This rank's step of every configuration; each one's first step is timed here (it compiles)."""
    classifier = TransformerClassifier(PRESETS[args.preset])
    batch = reference_batch(args.preset, args.batch_size)
    (lm, lm_loss), lm_batch = _lm_batch(args.lm_preset, args.batch_size)
    steps: dict[str, Step] = {}
    first: dict[str, float] = {}
    for name, (model_name, compiled, dynamic) in CONFIGS.items():
        pipeline = PipelineConfig(pp=PP, schedule="1f1b", n_microbatches=args.chunks, compile=compiled,
                                  compile_dynamic=dynamic)
        model, loss = (classifier, torch.nn.functional.cross_entropy) if model_name == "classifier" else (lm, lm_loss)
        x, y = batch if model_name == "classifier" else lm_batch
        engine = build_session(model, ParallelConfig(pipeline=pipeline), device, seed=SEED, loss_fn=loss).engine
        steps[name] = engine_step(engine, x, y)
        dist.barrier()
        started = time.perf_counter()
        steps[name]()
        first[name] = time.perf_counter() - started
    (Path(args.first_dir) / f"rank{spec.rank}.json").write_text(json.dumps(first))
    return steps


def summarize(report: dict, first: list[dict[str, float]]) -> tuple[list[dict], str]:
    times = report["times_s"]
    rows, records = [], []
    for name, (model_name, compiled, _) in CONFIGS.items():
        eager = f"{model_name} eager"
        ratio = paired_ratio(times[eager], times[name]) if compiled else 1.0
        first_s = max(rank[name] for rank in first)  # the slower rank's first step: what the job waits
        compile_s = first_s - max(rank[eager] for rank in first) if compiled else 0.0
        record = {"config": name, "median_step_s": median_s(times[name]), "eager_over_this": ratio,
                  "first_step_s": first_s, "compile_s": compile_s}
        records.append(record)
        rows.append([name, f"{record['median_step_s'] * 1e3:.1f}", f"{ratio:.2f}x" if compiled else "-",
                     f"{first_s:.1f}", f"{compile_s:.1f}" if compiled else "-"])
    table = markdown_table(["configuration (pp=2, 1f1b)", "median step (ms)", "eager / this (paired)",
                            "first step (s)", "compile time (s)"], rows)
    return records, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.set_defaults(batch_size=32)
    parser.add_argument("--lm-preset", default="cpu", help="the lm workload's preset (default: cpu)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per step (default: 4)")
    parser.add_argument("--cold", action="store_true", help="a fresh inductor cache folder: compile from scratch")
    args = parser.parse_args()
    resolve_defaults(args, full=FULL, quick=QUICK)
    with tempfile.TemporaryDirectory(prefix="pipetrain-compile-") as work:
        args.first_dir = work
        if args.cold:  # read by inductor in the spawned ranks (they inherit the environment)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(work) / "inductor")
        report = run_job(measure, args, world_size=PP)
        first = [json.loads((Path(work) / f"rank{r}.json").read_text()) for r in range(PP)]
    args.first_dir = None
    report["args"]["first_dir"] = None
    records, table = summarize(report, first)
    report["summary"] = records
    ratios = [r["eager_over_this"] for r in records if r["config"].endswith("compiled")]
    verdict = (f"goal >= {TARGET}x per step: {'met' if min(ratios) >= TARGET else 'not met'} "
               f"(compiled, static shapes: {', '.join(f'{r:.2f}x' for r in ratios)}; median of "
               f"{statistics.median(ratios):.2f}x)")
    text = (f"pp={PP}, 1f1b, {args.chunks} micro-batches, batch {args.batch_size}; classifier preset {args.preset}, "
            f"lm preset {args.lm_preset}; {args.rounds} rounds x {args.steps} steps"
            f"{', cold inductor cache' if args.cold else ''}\n\n{table}\n\n{verdict}")
    finish(report, text, args.json)


if __name__ == "__main__":
    main()
