"""Benchmark: each block of the `cpu` classifier, eager against compiled (`pipetrain.pipeline.compiled`), one process.

Forward + backward of one micro-batch of 8 (one thread), for the embedding, an encoder layer and the head, with
the preset's dropout (0.1) and without; eager and compiled calls alternate, and the ratio is the median of the
per-pair ratios, so machine load cancels. `--profile` also prints torch.profiler's top operators of the encoder
layer (dropout 0), eager then compiled. Run: `.venv/bin/python benchmarks/compile_blocks.py [--profile]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from pipetrain.pipeline.compiled import compile_blocks
from pipetrain.workloads.classifier.presets import PRESETS
from pipetrain.workloads.classifier.model import TransformerClassifier

MICRO = 8
PAIRS = 31


def _pair(model: TransformerClassifier, index: int, inputs: torch.Tensor) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """The eager and the compiled block `index`, same weights, each warmed (compiled) on `inputs`."""
    pair = []
    for compiled in (False, True):
        torch.manual_seed(0)
        block = model.build_block(index)
        if compiled:
            compile_blocks([block])
        x = inputs if index == 0 else inputs.clone().requires_grad_(True)
        for _ in range(2):
            block(x).float().sum().backward()
        pair.append((block, x))
    return pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", action="store_true", help="also print the encoder layer's top operators")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| block (cpu preset) | dropout | eager (ms) | compiled (ms) | eager / compiled (paired) |\n|---|---|---|---|---|")
    for dropout in (PRESETS["cpu"].dropout, 0.0):
        config = replace(PRESETS["cpu"], dropout=dropout)
        model = TransformerClassifier(config)
        hidden = torch.randn(MICRO, config.seq_len, config.emsize)
        for index, inputs in ((0, model.example_input(MICRO)), (1, hidden), (model.num_blocks - 1, hidden)):
            pair = _pair(model, index, inputs)
            times: list[list[float]] = [[], []]
            for _ in range(PAIRS):
                for k, (block, x) in enumerate(pair):
                    start = time.perf_counter()
                    block(x).float().sum().backward()
                    times[k].append(time.perf_counter() - start)
            ratio = statistics.median(e / c for e, c in zip(*times))
            eager, compiled = (statistics.median(t) * 1e3 for t in times)
            print(f"| {type(pair[0][0]).__name__} | {dropout} | {eager:.2f} | {compiled:.2f} | {ratio:.2f}x |")
    if args.profile:
        model = TransformerClassifier(replace(PRESETS["cpu"], dropout=0.0))
        for name, (block, x) in zip(("eager", "compiled"), _pair(model, 1, torch.randn(MICRO, 64, 64))):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    block(x).sum().backward()
            print(f"\n{name}, 10 steps:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
