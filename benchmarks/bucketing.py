"""Throughput of --bucket against padding every batch to its longest document, and memory over many lengths.

The language-model workload on its synthetic corpus (IMDB-like document lengths: median ~175 words, cut
to the model's window) at pp=2 (1F1B) on 2 CPU ranks. Configurations, all built in one spawned job with
the same weights, each visit = one whole epoch (the same documents every time):

- `padded`: shuffled batches, each padded to its longest document (rounded up to 8 tokens);
- `bucket`: batches of similar lengths (`--bucket`), room for every shape in the schedule cache;
- `bucket, cache N`: the same with room for only N shapes (`--shape-cache N`): schedules are evicted and
  rebuilt, and the resident memory of rank 0 is followed over the rounds (it must stay flat).

Rounds alternate the order of the configurations; the throughput gain is the median over rounds of
(padded epoch time / bucket epoch time), both epochs training on the same non-padding tokens.

    .venv/bin/python benchmarks/bucketing.py [--quick] [--seq-len 512] [--docs 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interleave import finish, markdown_table, paired_ratio  # noqa: E402

from pipetrain.bench.report import collect_environment
from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.launch.env import free_port
from pipetrain.launch.spawn import RankSpec, spawn
from pipetrain.pipeline import IGNORE_INDEX, TokenCrossEntropy
from pipetrain.session import build_session, close_session, join_job
from pipetrain.workloads.lm.corpus import LENGTH_STEP, synthetic_corpus, token_batches
from pipetrain.workloads.lm.gpt import GPT_PRESETS, GPTModel

WORLD = 2
FULL = {"seq_len": 512, "docs": 256, "rounds": 3}
QUICK = {"seq_len": 256, "docs": 64, "rounds": 2}


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _configs(args: argparse.Namespace) -> dict[str, tuple[bool, int]]:
    """name -> (bucket, shape cache size)."""
    every_shape = 2 * (args.seq_len // LENGTH_STEP + 1)  # training runs plus the short last batch's
    return {"padded": (False, every_shape), "bucket": (True, every_shape),
            f"bucket, cache {args.small_cache}": (True, args.small_cache)}


def _rank_main(spec: RankSpec, args: argparse.Namespace, out: str) -> None:
    device = join_job(spec)
    try:
        model = GPTModel(replace(GPT_PRESETS[args.preset], seq_len=args.seq_len))
        corpus, _ = synthetic_corpus(num_train=args.docs, num_test=1, seq_len=args.seq_len,
                                     vocab_size=model.config.vocab_size, seed=0)
        engines = {}
        for name, (bucket, cache) in _configs(args).items():
            pipeline = PipelineConfig(pp=WORLD, schedule="1f1b", n_microbatches=args.chunks, shape_cache=cache)
            session = build_session(model, ParallelConfig(pipeline=pipeline), device, seed=0, loss_fn=TokenCrossEntropy())
            engines[name] = (session.engine, torch.optim.SGD(session.engine.parameters(), lr=1e-3), bucket)

        def epoch(name: str, index: int) -> tuple[float, int, int]:
            engine, optimizer, bucket = engines[name]
            dist.barrier()
            start, tokens, padded = time.perf_counter(), 0, 0
            for x, y in token_batches(corpus, args.batch_size, shuffle=True, seed=0, epoch=index, bucket=bucket):
                optimizer.zero_grad(set_to_none=True)
                engine.step(x, y)  # ends with an all-reduce over both ranks
                optimizer.step()
                tokens += int((y != IGNORE_INDEX).sum())
                padded += y.numel()
            return time.perf_counter() - start, tokens, padded

        names = list(engines)
        for name in names:  # warm-up: one untimed epoch each (builds the schedules)
            epoch(name, 0)
        record = {name: {"epoch_s": [], "tokens": 0, "slots": 0, "rss_mb": [], "cached": [], "evictions": 0}
                  for name in names}
        for index in range(args.rounds):
            for name in names[index % 2:] + names[: index % 2]:
                seconds, tokens, slots = epoch(name, 1 + index)
                entry = record[name]
                entry["epoch_s"].append([seconds])
                entry["tokens"], entry["slots"] = tokens, slots
                entry["rss_mb"].append(_rss_mb())
                entry["cached"].append(len(engines[name][0].schedules))
                entry["evictions"] = engines[name][0].schedules.evictions
        if spec.rank == 0:
            Path(out, "record.json").write_text(json.dumps(record))
    finally:
        close_session()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu", help="GPT preset whose sizes are used (default: cpu)")
    parser.add_argument("--seq-len", type=int, help="model window: documents are cut to it (default: 512)")
    parser.add_argument("--docs", type=int, help="documents per epoch (default: 256)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--small-cache", type=int, default=4, help="shape-cache size of the third configuration")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--quick", action="store_true", help="window 256, 64 documents, 2 rounds")
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pipetrain-bucketing-") as work:
        spawn(_rank_main, ranks=range(WORLD), world_size=WORLD, master_addr="127.0.0.1", master_port=free_port(),
              args=(args, work), timeout_s=3600)
        record = json.loads(Path(work, "record.json").read_text())
    names = list(record)
    rows = []
    for name in names:
        entry = record[name]
        seconds = statistics.median(t for visit in entry["epoch_s"] for t in visit)
        rss = entry["rss_mb"]
        rows.append([name, f"{seconds:.1f}", f"{entry['tokens'] / seconds:.0f}",
                     f"{1 - entry['tokens'] / entry['slots']:.0%}",
                     f"{paired_ratio(record['padded']['epoch_s'], entry['epoch_s']):.2f}x",
                     f"{max(entry['cached'])} ({entry['evictions']} evicted)",
                     " -> ".join(f"{value:.0f}" for value in rss)])
    text = "\n".join([
        f"LM workload ({args.preset} sizes, window {args.seq_len}), {args.docs} synthetic documents per epoch, "
        f"batch {args.batch_size}, pp={WORLD} 1F1B, {args.chunks} chunks; {args.rounds} rounds, one epoch per visit",
        "",
        markdown_table(["configuration", "epoch s (median)", "tokens/s", "padding", "gain vs padded (paired)",
                        "schedules cached", "rank-0 RSS MB per round"], rows),
        "",
        "tokens/s counts non-padding (trained) tokens; padding = share of the batch slots that are padding.",
    ])
    report = {"environment": collect_environment(sys.argv, device="cpu"), "args": vars(args) | {"json": str(args.json)},
              "wall_s": time.perf_counter() - started, "load_avg_before": list(load_before),
              "load_avg_after": list(os.getloadavg()), "record": record}
    finish(report, text, args.json)


if __name__ == "__main__":
    main()
