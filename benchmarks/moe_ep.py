"""Benchmark: a MoE training step at dp 2 × pp 2 with its experts whole (ep 1), split over 2 ranks (ep 2), and split
with the all-to-alls replaced by a local copy of the same shape (ep 2, no all-to-all), side by side in one run.

One spawned job of 4 gloo ranks (one thread each) builds three sessions of the same tiny-but-not-trivial Qwen3-MoE
(`--hidden 256`, `--experts 8`, top 2, `--layers 4`, from its transformers config, random weights) under 1F1B with
2 micro-batches, then times `--steps` steps of each, the three alternating, `--repeats` times (after one warm-up
round), and prints the tokens/s of each: the median and the spread (min-max) over the repeats, and the step-time
ratios paired within each repeat (ep2 / ep1, ep2 / ep2 without all-to-all), which a loaded machine's drift moves less.

"no all-to-all" is a measurement knob of this script only, not a pipetrain option: during its steps,
`pipetrain.moe.dispatch`'s `all_to_all_single` is replaced by a copy of the rank's own rows (the counts a rank
sends stand for those it receives, so every exchanged tensor keeps its size and the experts do the same work on
other rows). The difference between the last two rows is what the all-to-alls cost in the step: what an overlap
(DualPipeV's, not built) could at most hide.
Run: `PYTHONPATH=src .venv/bin/python benchmarks/moe_ep.py [--repeats 5] [--steps 4]`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.moe import dispatch as moe_dispatch
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.hf.causal_lm import HFCausalLM

VARIANTS = ("ep1", "ep2", "ep2 no all-to-all")


def _model(args: argparse.Namespace) -> HFCausalLM:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden, num_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=args.seq, output_router_logits=False)
    return HFCausalLM(config, seq_len=args.seq)


def _local_all_to_all(out: torch.Tensor, rows: torch.Tensor, *args, **kwargs) -> None:
    """The measurement knob: the rank's own rows in place of what the all-to-all would bring (same size)."""
    out.copy_(rows)


@contextmanager
def _without_all_to_all():
    real = moe_dispatch.dist
    moe_dispatch.dist = SimpleNamespace(all_to_all_single=_local_all_to_all, get_world_size=real.get_world_size)
    try:
        yield
    finally:
        moe_dispatch.dist = real


def _worker(spec: RankSpec, args: argparse.Namespace, out: str) -> None:
    device = join_job(spec)
    try:
        model = _model(args)
        pipeline = PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2)
        sessions = {name: build_session(model, ParallelConfig(dp=2, ep=1 if name == "ep1" else 2, pipeline=pipeline),
                                        device, seed=0, loss_fn=model.loss()) for name in VARIANTS}
        dp_rank = sessions["ep1"].mesh.dp_rank
        gen = torch.Generator().manual_seed(dp_rank)
        ids = torch.randint(0, args.vocab, (args.batch // 2, args.seq), generator=gen)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, session in sessions.items():
                knob = _without_all_to_all() if name.endswith("no all-to-all") else _nothing()
                dist.barrier()
                start = time.perf_counter()
                with knob:
                    for _ in range(args.steps):
                        session.engine.step(ids, ids)
                dist.barrier()
                if repeat:
                    times[name].append((time.perf_counter() - start) / args.steps)
        if spec.rank == 0:
            torch.save(times, Path(out) / "times.pt")
    finally:
        close_session()


@contextmanager
def _nothing():
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (samples; 2 replicas x 2 micro-batches)")
    parser.add_argument("--steps", type=int, default=4, help="steps timed together")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, ranks=range(4), world_size=4, master_addr="127.0.0.1", master_port=free_port(),
              args=(args, out), timeout_s=3600)
        times = torch.load(Path(out) / "times.pt")
    tokens = args.batch * args.seq
    print(f"Qwen3-MoE hidden {args.hidden}, {args.experts} experts top-2, {args.layers} layers, vocab {args.vocab}; "
          f"dp 2 x pp 2, 1F1B, 2 micro-batches, {tokens} tokens a step; gloo, 1 thread a rank; "
          f"torch {torch.__version__}; median (min-max) of {args.repeats} repeats of {args.steps} steps")
    print(f"{'layout':>20} {'s/step':>8} {'tokens/s':>9} {'tokens/s min-max':>17}")
    for name, values in times.items():
        rates = [tokens / t for t in values]
        print(f"{name:>20} {statistics.median(values):8.3f} {statistics.median(rates):9.0f} "
              f"{min(rates):8.0f}-{max(rates):<8.0f}")
    ep2, local = statistics.median(times["ep2"]), statistics.median(times["ep2 no all-to-all"])
    print(f"all-to-alls: {ep2 - local:.3f} s of the ep2 step ({100 * (ep2 - local) / ep2:.0f} %)")
    for a, b in (("ep2", "ep1"), ("ep2", "ep2 no all-to-all")):  # paired within each repeat: less of the drift
        ratios = [x / y for x, y in zip(times[a], times[b])]
        print(f"step time {a} / {b}, per repeat: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
