"""Benchmark: context parallelism on CPU ranks: tokens/s and activation memory per rank at cp 1, 2, 4, ring and
all-to-all (ulysses) attention side by side, and the ring's overlap of its exchange with the attention, one sequence
per step, in one run.

Each cell is a fresh job of `cp` gloo ranks (`pipetrain.launch_local`) training a small Llama built by transformers'
config (hidden 64, 2 layers, 4 query and 4 key/value heads, so ulysses runs at cp 4 too; positions up to 32,768) on
one random sequence of `--seq` tokens per step (SGD). The ring runs three ways at cp 2 (and 4): its exchange
overlapped with the block attention (the default), synchronous (`sync`: send, wait, then attend), and removed
(`local`: a local copy of the same shape instead of the exchange; wrong attention, the same compute: measurement
only), set through `ContextParallel.exchange` in the ranks; `-ops` cells run the ring's block attention in torch ops
instead of torch's fused kernel (`ContextParallel.kernel`). Printed per cell: the median step time (a step's time:
the slowest rank's) over `--steps` timed steps of each of `--rounds` rounds, the spread of the rounds' medians,
tokens/s and its ratio to cp 1, and the activation memory per rank: the bytes autograd saves for the backward in one
step (`saved_tensors_hooks`), the most of any rank: each save counted (`saves`: a tensor several ops save, as the
normed input of the q, k and v projections, counts each time) and each storage once (`held`: what the saved tensors
occupy), beside the planner's figure for the same config, sequence and cp (`planned`: `stage_costs` and
`last_stage` of plan/, fp32 activations, activation factor 1: the bytes counted, not an allocator's). cp 1 is the unsplit model with transformers' sdpa attention (the
fused CPU kernel, which saves no score matrix); cp > 1 runs pipetrain's ring (its blocks through the same fused
kernel, or torch ops in `-ops` cells) or all-to-all attention. Then, per cp: the exchange's exposed time (sync -
local) and the share of it the overlap hides ((sync - overlap) / (sync - local)).
The rounds run every cell one after another, so that a shared machine's changing load falls on all alike.
Run: `.venv/bin/python benchmarks/context_parallel.py [--seq 4096] [--steps 3] [--rounds 3] [--cells ...]`.
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
from pipetrain.context import ContextParallel
from pipetrain.plan.hardware import DEFAULT_NETWORK, default_device
from pipetrain.plan.loss import last_stage
from pipetrain.plan.predict import Layout, stage_costs
from pipetrain.plan.transformer import sizes_from_config
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.hf.causal_lm import HFCausalLM, causal_lm_loss

#: name -> (cp, attention, the ring's exchange, the ring's block kernel)
CELLS = {"cp1": (1, "ring", "overlap", "fused"), "cp2-ring": (2, "ring", "overlap", "fused"),
         "cp2-ring-sync": (2, "ring", "sync", "fused"), "cp2-ring-local": (2, "ring", "local", "fused"),
         "cp2-ring-ops": (2, "ring", "overlap", "ops"), "cp2-ulysses": (2, "ulysses", "overlap", "fused"),
         "cp4-ring": (4, "ring", "overlap", "fused"), "cp4-ring-sync": (4, "ring", "sync", "fused"),
         "cp4-ring-local": (4, "ring", "local", "fused"), "cp4-ring-ops": (4, "ring", "overlap", "ops"),
         "cp4-ulysses": (4, "ulysses", "overlap", "fused")}
DEFAULT_CELLS = ("cp1", "cp2-ring", "cp2-ring-sync", "cp2-ring-local", "cp2-ring-ops", "cp2-ulysses", "cp4-ring",
                 "cp4-ulysses")
POSITIONS = 32768


def _config(seq: int):
    import transformers

    return transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4,
                                    max_position_embeddings=max(seq, POSITIONS))


def planned(seq: int, cp: int, attention: str) -> float:
    """The bytes of activations the planner prices one rank to keep for its backward: one sequence of `seq`
    tokens split over `cp` ranks, one stage, fp32 (its blocks' and the loss's log-softmax: the logits die with the
    loss's forward, in the last stage's)."""
    blocks = sizes_from_config(_config(seq).to_dict()).blocks(seq, element=4)
    layout = Layout(dp=1, pp=1, batch=1, chunks=1, cp=cp, cp_attention=attention)
    cost = stage_costs(blocks, layout, default_device(), DEFAULT_NETWORK, [(0, len(blocks))])[0]
    return last_stage(cost, blocks[-1], 1 / cp, keep=False).activation_bytes


def _cell(spec: pipetrain.RankSpec, seq: int, cp: int, attention: str, exchange: str, kernel: str, steps: int,
          warmup: int, out: str) -> None:
    device = join_job(spec)
    ContextParallel.exchange, ContextParallel.kernel = exchange, kernel  # measurement switches, this rank only
    try:
        parallel = ParallelConfig(pipeline=PipelineConfig(pp=1), cp=cp, cp_attention=attention)
        session = build_session(HFCausalLM(_config(seq), seq_len=seq), parallel, device, loss_fn=causal_lm_loss)
        opt = torch.optim.SGD(session.engine.parameters(), lr=0.01)
        ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(0))
        saved, held, times = [0], {}, []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved[0] += tensor.numel() * tensor.element_size()
            storage = tensor.untyped_storage()  # alive to the backward: its address is not reused meanwhile
            held[storage.data_ptr()] = storage.nbytes()
            return tensor

        for step in range(warmup + steps):
            saved[0] = 0
            held.clear()
            opt.zero_grad()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                session.engine.step(ids, ids)
            opt.step()
            if step >= warmup:
                times.append(time.perf_counter() - start)
        torch.save({"step_s": times, "saved": saved[0], "held": sum(held.values())}, Path(out) / f"rank{spec.rank}.pt")
    finally:
        close_session()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every cell, one after another")
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS), help=f"comma-separated, of: {', '.join(CELLS)}")
    args = parser.parse_args()
    names = args.cells.split(",")
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    saved: dict[str, int] = {}
    held: dict[str, int] = {}
    for _ in range(args.rounds):  # rounds interleave the cells: the shared machine's load falls on all of them alike
        for name in names:
            cp, attention, exchange, kernel = CELLS[name]
            out = tempfile.mkdtemp()
            pipetrain.launch_local(_cell, cp, args.seq, cp, attention, exchange, kernel, args.steps, args.warmup, out)
            records = [torch.load(Path(out) / f"rank{r}.pt") for r in range(cp)]
            times[name].append([max(step) for step in zip(*(r["step_s"] for r in records))])  # the slowest rank's
            saved[name] = max(r["saved"] for r in records)
            held[name] = max(r["held"] for r in records)
    rows = {}
    for name in names:
        rounds = [statistics.median(steps) for steps in times[name]]
        every = [t for steps in times[name] for t in steps]
        rows[name] = (CELLS[name][0], statistics.median(every), min(rounds), max(rounds), saved[name], held[name],
                      planned(args.seq, CELLS[name][0], CELLS[name][1]))
    print(f"{args.seq} tokens a step, Llama hidden 64 x 2 layers (positions to {POSITIONS}), median of "
          f"{args.steps * args.rounds} timed steps ({args.steps} after {args.warmup} warm-up in each of {args.rounds} "
          f"rounds; spread: the rounds' medians), gloo, one thread per rank, 2 CPU cores shared with other jobs "
          f"(1-min load at the end: {os.getloadavg()[0]:.1f})\n")
    print("| cell | ranks | median step (s) | spread (s) | tokens/s | vs cp1 | activation memory per rank, saves (MB) "
          "| vs cp1 | held (MB) | planned (MB) | held / planned |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = rows.get("cp1")
    for name, (cp, step, low, high, saved, kept, plan) in rows.items():
        speed, memory = (f"{base[1] / step:.2f}x", f"{saved / base[4]:.2f}x") if base else ("-", "-")
        print(f"| {name} | {cp} | {step:.3f} | {low:.3f}-{high:.3f} | {args.seq / step:,.0f} | {speed} | "
              f"{saved / 2**20:.1f} | {memory} | {kept / 2**20:.1f} | {plan / 2**20:.1f} | {kept / plan:.2f} |")
    print("\nvs cp1 (speed): cp1's step time / this cell's (> 1 is faster); (memory): this cell's / cp1's.")
    for cp in (2, 4):
        cells = [rows.get(f"cp{cp}-ring{tail}") for tail in ("", "-sync", "-local")]
        if all(cells):
            overlap, sync, local = (cell[1] for cell in cells)
            hidden = f"{(sync - overlap) / (sync - local):.0%}" if sync > local else "n/a (sync <= local)"
            print(f"cp{cp} ring: exchange exposed (sync - local) {sync - local:.3f} s a step, overlap saves "
                  f"{sync - overlap:.3f} s: {hidden} of it hidden")


if __name__ == "__main__":
    main()
