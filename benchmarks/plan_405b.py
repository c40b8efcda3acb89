"""`pipetrain plan --model` of Llama 3.1 405B beside torchtitan's published H100 figures, and how long it takes.

    python benchmarks/plan_405b.py [--repeats 5]

torchtitan's docs/performance.md, Table 5 (512 H100 96 GB, FSDP 8 × TP 8 × PP 8, local batch 32, global 256, full
recomputation, bf16 + Float8 linears + torch.compile + async TP; torchtitan 9dec370, torch 1963fc8, Dec 2024): 1F1B
100 tokens/s/GPU at 82.5 GiB, interleaved 1F1B 128 at 72.7 GiB (the most any rank's allocator reserved). Kept back to
judge the plan: Table 6's 1F1B row FSDP 8 × TP 8 × PP 8, CP 1, local batch 8 of 32768 tokens (76 tokens/s/GPU at
75.3 GiB): the same 8 micro-batches of 32768 tokens as Table 5's 1F1B, so the same allocations. The plan
is that layout as torchtitan ran it by default (8 micro-batches = pp, 2 stages per rank for the interleaved
schedule, seq len 8192) with the what-if flags for what pipetrain's engine does differently (per-layer
recomputation, vocabulary-parallel embedding and head, Float8 weights gathered in float8, the last stage's outputs
kept by torch's schedule to the step's end as torchtitan's loop leaves them, in bf16: torchtitan's model returns its
output layer's bf16 logits and its loss casts a copy to fp32, `--bf16-logits`), on the stated H100 node
(`hardware.NODES`, bf16: 950 TFLOP/s). Then the same layout as pipetrain itself would run it (its own recomputation
of a whole stage, embedding and head split over the vocabulary as train's `--loss-parallel` runs them, no Float8,
each micro-batch's outputs dropped after its loss), and beside it without `--loss-parallel` (embedding and head
whole on each tensor-parallel rank). Last, the whole command's wall
time in a fresh interpreter (median of `--repeats`), and whether it imported torch or transformers. The memory is the
largest of the planner's moments (plan/predict.py); what it does not model is in docs/memory.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipetrain.cli.main import build_parser
from pipetrain.cli.plan import planned

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "benchmarks" / "models" / "llama-3.1-405b" / "config.json"
PUBLISHED = {"1f1b": (100, 82.5), "interleaved-1f1b": (128, 72.7)}
LAYOUT = ["plan", "--model", str(CONFIG), "--seq-len", "8192", "--nodes", "64", "--gpus-per-node", "8",
          "--gpu-mem", "95", "--tp", "8", "--pp", "8", "--sequence-parallel", "on", "--dp-modes", "fsdp",
          "--checkpoints", "always", "--batch", "256", "--chunks", "8", "--stages-per-rank", "2",
          "--schedules", "1f1b,interleaved-1f1b", "--precision", "bf16", "--gpu", "h100-sxm"]
TORCHTITAN = LAYOUT + ["--float8", "--recompute-unit", "layer", "--loss-parallel", "--keep-outputs", "--bf16-logits"]


def _plan(argv: list[str]) -> dict:
    result, _ = planned(build_parser(argv).parse_args(argv))
    return {p.layout.schedule: p for p in result.best + result.too_big}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gib, tokens = 2**30, 256 * 8192 / 512
    print("| schedule | torchtitan tokens/s/GPU | planned | torchtitan GiB | planned GiB | planned / published "
          "| pipetrain's own engine (--loss-parallel): planned GiB | without --loss-parallel |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    roomy = [a if b != "--gpu-mem" else "1000" for b, a in zip([""] + LAYOUT, LAYOUT)]  # pipetrain's own: too big
    titan, own, whole = _plan(TORCHTITAN), _plan(roomy + ["--loss-parallel"]), _plan(roomy)
    for schedule, (tps, mem) in PUBLISHED.items():
        p, q, w = titan[schedule], own[schedule], whole[schedule]
        planned_mem = max(p.memory_bytes) / gib
        print(f"| {schedule} | {tps} | {tokens / p.step_s:.1f} | {mem} | {planned_mem:.1f} | "
              f"{planned_mem / mem:.3f} | {max(q.memory_bytes) / gib:.1f} | {max(w.memory_bytes) / gib:.1f} |")
    table6 = [a if b not in ("--seq-len", "--batch", "--schedules") else {"--seq-len": "32768", "--batch": "64",
              "--schedules": "1f1b"}[b] for b, a in zip([""] + TORCHTITAN, TORCHTITAN)]
    (t6,) = _plan(table6).values()
    t6_mem = max(t6.memory_bytes) / gib
    print(f"| 1f1b, Table 6 (FSDP 8, CP 1, 8 × 32768 tokens) | 76 | {64 * 32768 / 512 / t6.step_s:.1f} | 75.3 | "
          f"{t6_mem:.1f} | {t6_mem / 75.3:.3f} | | |")
    ratio = titan["1f1b"].step_s / titan["interleaved-1f1b"].step_s
    engine = own["1f1b"].step_s / own["interleaved-1f1b"].step_s
    print(f"\ninterleaved / 1F1B throughput: published {128 / 100:.2f}, planned {ratio:.3f} "
          f"({100 * (ratio / 1.28 - 1):+.1f} %); pipetrain's own engine {engine:.3f}")
    for schedule in PUBLISHED:
        print(f"{schedule}: memory per pipeline rank (GiB) " +
              " ".join(f"{m / gib:.1f}" for m in titan[schedule].memory_bytes))
    code = "\n".join([
        "import contextlib, io, sys, time", "start = time.perf_counter()", "from pipetrain.cli.main import main",
        "with contextlib.redirect_stdout(io.StringIO()):", f"    assert main({TORCHTITAN!r}) == 0",
        "print(time.perf_counter() - start, 'torch' in sys.modules, 'transformers' in sys.modules, file=sys.stderr)"])
    walls, inner = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        walls.append(time.perf_counter() - start)
        took, torch_loaded, hf_loaded = run.stderr.split()[-3:]
        inner.append(float(took))
    print(f"\nthe whole command in a fresh interpreter: {statistics.median(walls):.3f} s median "
          f"({min(walls):.3f}-{max(walls):.3f} s over {args.repeats}); import + plan + print "
          f"{statistics.median(inner):.3f} s; torch imported: {torch_loaded}, transformers imported: {hf_loaded}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
