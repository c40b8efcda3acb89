"""The simulated bubble of each schedule on equal stages, as a markdown table (`pipetrain.plan.bubbles`); with
`--calibration FILE`, the planner's full predictions for a preset of the reference Transformer instead.

    python benchmarks/bubble_table.py --pp 2 4 --per-rank 2 4 8
    python benchmarks/bubble_table.py --calibration FILE --preset cpu --batch 64

Pure prediction: no torch, no process.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pipetrain.plan.bubbles import bubble_rows, markdown, predicted_markdown
from pipetrain.plan.model import config_blocks
from pipetrain.workloads.classifier.presets import PRESETS


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--per-rank", type=int, nargs="+", default=[2, 4, 8], help="micro-batches per pp rank")
    parser.add_argument("--calibration", default=None, help="a calibration file: print the planner's predictions")
    parser.add_argument("--preset", default="cpu", help="model preset for --calibration (default: cpu)")
    parser.add_argument("--batch", type=int, default=64, help="batch for --calibration (default: 64)")
    args = parser.parse_args(argv)
    if args.calibration:
        blocks = config_blocks(PRESETS[args.preset])
        print(predicted_markdown(args.calibration, blocks, args.batch, args.pp, args.per_rank))
    else:
        print(markdown(bubble_rows(args.pp, args.per_rank)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
