"""Benchmark: one rank's local experts as two grouped matmuls against a loop over the experts, side by side.

`run_experts` (pipetrain.moe.experts) runs the rows each local expert received through its gated MLP, either with
`grouped_mm` (one kernel per projection for all experts) or with one `F.linear` per expert and projection. For each
dtype, the same rows (tokens × top-k spread over the experts by a random top-k routing) and weights are timed
forward + backward in both ways, alternating, on one thread; medians of `--repeats`, and the loop/grouped ratio.
Run: `.venv/bin/python benchmarks/moe_experts.py [--experts 8] [--tokens 2048] [--hidden 256] [--inter 512]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pipetrain.moe.experts import run_experts


def _time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8, help="local experts")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    experts = torch.randint(0, args.experts, (args.tokens * args.top_k,), generator=gen)
    counts = torch.bincount(experts, minlength=args.experts).tolist()
    print(f"{args.experts} experts, {args.tokens} tokens x top-{args.top_k}, hidden {args.hidden}, "
          f"intermediate {args.inter}, torch {torch.__version__}, forward + backward, median of {args.repeats}")
    print(f"{'dtype':>9} {'grouped ms':>11} {'loop ms':>9} {'loop/grouped':>13}")
    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(sum(counts), args.hidden, generator=gen).to(dtype).requires_grad_(True)
        gate_up = (torch.randn(args.experts, 2 * args.inter, args.hidden, generator=gen) * 0.05).to(dtype)
        down = (torch.randn(args.experts, args.hidden, args.inter, generator=gen) * 0.05).to(dtype)
        gate_up.requires_grad_(True)
        down.requires_grad_(True)

        def step(grouped: bool) -> None:
            out = run_experts(rows, counts, gate_up, down, F.silu, grouped=grouped)
            out.backward(torch.ones_like(out))

        for grouped in (True, False):  # warm-up
            step(grouped)
        grouped_s = _time(lambda: step(True), args.repeats)
        loop_s = _time(lambda: step(False), args.repeats)
        print(f"{str(dtype).removeprefix('torch.'):>9} {grouped_s * 1e3:11.1f} {loop_s * 1e3:9.1f} "
              f"{loop_s / grouped_s:13.2f}")


if __name__ == "__main__":
    main()
