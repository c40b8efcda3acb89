"""`pipetrain plan` against every memory figure torchtitan published for Llama 3.1 on H100s (Dec 2024).

    python benchmarks/plan_torchtitan.py

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, torch 1963fc8; 96 GB H100s, 8 a node;
memory = the most any rank's caching allocator reserved, in GiB). Each row is planned at its layout with the options
torchtitan ran (what pipetrain's train does differently is a what-if flag of `plan`):
- Tables 1 and 3 (8B, FSDP 8 / 128, local batch 2 x 8192, selective op recomputation: every other matrix product
  kept, `--selective-matmuls alternate`; FSDP resharding at pp 1; the model returns bf16 logits, the loss casts a
  copy, the loop drops the logits after the loss: `--bf16-logits`, outputs not kept);
- Table 2 (8B, FSDP x CP, one sequence of 32768 x CP tokens a rank, full recomputation, Float8);
- Table 4 (70B, FSDP 32 x TP 8 with sequence and loss parallelism, local batch 16, full recomputation, Float8);
- Tables 5 and 6 (405B, FSDP 8 x TP 8 x PP 8): benchmarks/plan_405b.py, repeated here for one table, and Table 6's
  context-parallel rows.
torch.compile's savings (Table 1: 82.4 -> 77.0 GiB) are not modelled: rows run with compile are marked. A row is within
the issue's bound when planned / published is in 0.90-1.10.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from pipetrain.cli.main import build_parser
from pipetrain.cli.plan import planned
from pipetrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "benchmarks" / "models"
H100 = ["--gpu", "h100-sxm", "--gpu-mem", "95", "--precision", "bf16", "--gpus-per-node", "8"]
FSDP_PP1 = ["--dp-modes", "fsdp", "--pp", "1", "--chunks", "1", "--fsdp-reshard", "always", "--bf16-logits"]
SELECTIVE = ["--checkpoints", "always", "--recompute-unit", "selective", "--selective-matmuls", "alternate"]
FULL = ["--checkpoints", "always", "--recompute-unit", "layer"]
PP_405B = ["--tp", "8", "--pp", "8", "--sequence-parallel", "on", "--dp-modes", "fsdp", "--chunks", "8",
           "--float8", "--loss-parallel", "--keep-outputs", "--bf16-logits", *FULL]

#: (table, row, compiled, published GiB, plan arguments)
ROWS = [
    ("1", "8B FSDP 8", False, 82.4,
     ["--model", "llama-3.1-8b", "--gpus", "8", "--batch", "16", "--seq-len", "8192", "--tp", "1", *FSDP_PP1,
      *SELECTIVE]),
    ("3", "8B FSDP 128", False, 67.0,
     ["--model", "llama-3.1-8b", "--gpus", "128", "--batch", "256", "--seq-len", "8192", "--tp", "1", *FSDP_PP1,
      *SELECTIVE]),
    *[("2", f"8B FSDP {8 // cp} CP {cp}", True, mem,
       ["--model", "llama-3.1-8b", "--gpus", "8", "--batch", str(8 // cp), "--seq-len", str(32768 * cp), "--tp", "1",
        "--cp", str(cp), *FSDP_PP1, *FULL, "--float8"])
      for cp, mem in ((1, 83.9), (2, 84.2), (4, 84.0))],
    ("4", "70B FSDP 32 TP 8", True, 71.9,
     ["--model", "llama-3.1-70b", "--gpus", "256", "--batch", "512", "--seq-len", "8192", "--tp", "8",
      "--sequence-parallel", "on", "--loss-parallel", "--float8", *FSDP_PP1, *FULL]),
    ("5", "405B 1F1B", True, 82.5,
     ["--model", "llama-3.1-405b", "--gpus", "512", "--batch", "256", "--seq-len", "8192", "--schedules", "1f1b",
      *PP_405B]),
    ("5", "405B interleaved 1F1B", True, 72.7,
     ["--model", "llama-3.1-405b", "--gpus", "512", "--batch", "256", "--seq-len", "8192", "--schedules",
      "interleaved-1f1b", "--stages-per-rank", "2", *PP_405B]),
    *[("6", f"405B FSDP {8 // cp} CP {cp} 1F1B", True, mem,
       ["--model", "llama-3.1-405b", "--gpus", "512", "--batch", str(64 // cp), "--seq-len", str(32768 * cp),
        "--cp", str(cp), "--schedules", "1f1b", *PP_405B])
      for cp, mem in ((1, 75.3), (2, 75.9), (4, 77.1))],
]


def plan_row(argv: list[str]) -> float | str:
    """The planned peak (GiB, the most of any rank) of the one layout `argv` allows, or the planner's refusal."""
    argv = ["plan", *[str(MODELS / a / "config.json") if a.startswith("llama-3.1") else a for a in argv], *H100]
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            result, _ = planned(build_parser(argv).parse_args(argv))
        except ConfigError as refused:
            return str(refused).split(" (hint")[0]
    layouts = result.best + result.too_big
    return min(max(p.memory_bytes) for p in layouts) / 2**30 if layouts else "no layout"


def main() -> None:
    print("| table | row | compiled | torchtitan GiB | planned GiB | planned / published |")
    print("|---|---|---|---:|---:|---:|")
    within, refused = 0, []
    for table, row, compiled, published, argv in ROWS:
        mem = plan_row(argv)
        if isinstance(mem, str):
            refused.append(f"{row}: {mem}")
            print(f"| {table} | {row} | {'yes' if compiled else 'no'} | {published} | - | refused |")
            continue
        within += 0.9 <= mem / published <= 1.1
        print(f"| {table} | {row} | {'yes' if compiled else 'no'} | {published} | {mem:.1f} | {mem / published:.3f} |")
    print(f"\n{within} of {len(ROWS) - len(refused)} planned rows within 10 %; load average {os.getloadavg()[0]:.1f}")
    for line in refused:
        print(f"refused: {line}")


if __name__ == "__main__":
    main()
