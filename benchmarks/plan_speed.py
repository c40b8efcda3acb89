"""How long `pipetrain plan` takes to plan 4,096 GPUs (the search only, interpreter start-up excluded).

    python benchmarks/plan_speed.py [--gpus 4096] [--batch 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipetrain.plan.hardware import DEFAULT_DEVICE, DEFAULT_NETWORK
from pipetrain.plan.model import transformer_blocks
from pipetrain.plan.predict import clear_caches
from pipetrain.plan.search import search
from pipetrain.workloads.transformer import PRESETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--preset", default="gpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    c = PRESETS[args.preset]
    blocks = transformer_blocks(vocab_size=c.vocab_size, seq_len=c.seq_len, emsize=c.emsize, nhead=c.nhead,
                                nhid=c.nhid, nlayers=c.nlayers, num_classes=c.num_classes, dropout=c.dropout)
    times = []
    for _ in range(args.repeats):
        clear_caches()  # every repeat starts cold
        start = time.perf_counter()
        result = search(blocks, gpus=args.gpus, batch=args.batch, device=DEFAULT_DEVICE, network=DEFAULT_NETWORK)
        times.append(time.perf_counter() - start)
    print(f"{args.gpus} GPUs, preset {args.preset}, batch {args.batch}: {result.enumerated} layouts, "
          f"{result.simulated} simulated; plan time median {statistics.median(times):.3f} s, "
          f"min {min(times):.3f} s, max {max(times):.3f} s over {args.repeats} runs (machine shared)")


if __name__ == "__main__":
    main()
