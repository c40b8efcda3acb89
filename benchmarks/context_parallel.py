"""Benchmark: context parallelism on CPU ranks: tokens/s and activation memory per rank at cp 1, 2, 4, ring and
all-to-all (ulysses) attention side by side, one sequence per step.

Each cell is a fresh job of `cp` gloo ranks (`pipetrain.launch_local`) training a small Llama built by transformers'
config (hidden 64, 2 layers, 4 query and 4 key/value heads, so ulysses runs at cp 4 too) on one random sequence of
`--seq` tokens per step (SGD). Printed per cell: the median step time, tokens/s and its ratio to cp 1, and the
activation memory per rank: the bytes autograd saves for the backward in one step (`saved_tensors_hooks`), the
most of any rank. cp 1 is the unsplit model with transformers' sdpa attention (the fused CPU kernel, which saves no
score matrix); cp > 1 runs pipetrain's ring or all-to-all attention, whose blocks are written in torch ops and
save their scores: memory per rank falls as 1/cp for the projections and MLPs, as 1/cp^2 per ring block for scores.
Run: `.venv/bin/python benchmarks/context_parallel.py [--seq 2048] [--steps 3]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import pipetrain
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss

CELLS = [("cp1", 1, "ring"), ("cp2-ring", 2, "ring"), ("cp2-ulysses", 2, "ulysses"), ("cp4-ring", 4, "ring"),
         ("cp4-ulysses", 4, "ulysses")]


def _config(seq: int):
    import transformers

    return transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=seq)


def _cell(spec: pipetrain.RankSpec, seq: int, cp: int, attention: str, steps: int, warmup: int, out: str) -> None:
    device = join_job(spec)
    try:
        parallel = ParallelConfig(pipeline=PipelineConfig(pp=1), cp=cp, cp_attention=attention)
        session = build_session(HFCausalLM(_config(seq), seq_len=seq), parallel, device, loss_fn=causal_lm_loss)
        opt = torch.optim.SGD(session.engine.parameters(), lr=0.01)
        ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(0))
        saved, times = [0], []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        for step in range(warmup + steps):
            saved[0] = 0
            opt.zero_grad()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                session.engine.step(ids, ids)
            opt.step()
            if step >= warmup:
                times.append(time.perf_counter() - start)
        torch.save({"step_s": statistics.median(times), "saved": saved[0]}, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    rows = {}
    for name, cp, attention in CELLS:
        out = tempfile.mkdtemp()
        pipetrain.launch_local(_cell, cp, args.seq, cp, attention, args.steps, args.warmup, out)
        records = [torch.load(Path(out) / f"rank{r}.pt") for r in range(cp)]
        rows[name] = (cp, max(r["step_s"] for r in records), max(r["saved"] for r in records))
    print(f"{args.seq} tokens a step, Llama hidden 64 x 2 layers, {args.steps} timed steps after {args.warmup} "
          f"warm-up, gloo, one thread per rank, 2 shared CPU cores (1-min load at the end: {os.getloadavg()[0]:.1f})\n")
    print("| cell | ranks | median step (s) | tokens/s | vs cp1 | activation memory per rank (MB) | vs cp1 |")
    print("|---|---|---|---|---|---|---|")
    base_step, base_mem = rows["cp1"][1], rows["cp1"][2]
    for name, (cp, step, saved) in rows.items():
        print(f"| {name} | {cp} | {step:.3f} | {args.seq / step:,.0f} | {base_step / step:.2f}x | "
              f"{saved / 2**20:.1f} | {saved / base_mem:.2f}x |")
    print("\nvs cp1 (speed): cp1's step time / this cell's (> 1 is faster); (memory): this cell's / cp1's.")


if __name__ == "__main__":
    main()
