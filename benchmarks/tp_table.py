"""Where tensor parallelism wins, as the planner predicts it, for a preset of the reference Transformer: one GPU
node, every tp × pp × dp that fills it (`pipetrain.plan.tp_table.node_cells`), as a markdown table.

    python benchmarks/tp_table.py                     # gpu preset, A100 and H100, 4 and 8 GPUs
    python benchmarks/tp_table.py --batch 32 --node h100 --gpus 8
    python benchmarks/tp_table.py --preset cpu --gpus 2 --batch 64 --calibration FILE  # this machine

Pure prediction: no torch, no process.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pipetrain.plan.hardware import NODES, load_calibration
from pipetrain.plan.model import config_blocks
from pipetrain.plan.predict import Prediction
from pipetrain.plan.tp_table import node_cells
from pipetrain.workloads.classifier.presets import PRESETS

_GB = 2**30


def _describe(p: Prediction) -> str:
    lay = p.layout
    schedule = lay.schedule + (f"x{lay.virtual}" if lay.virtual > 1 else "")
    mode = lay.dp_mode if lay.dp > 1 else "-"
    return f"{schedule}, {lay.chunks} chunks, {lay.checkpoint}, {mode}{', sp' if lay.sequence_parallel else ''}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpu", choices=tuple(PRESETS))
    parser.add_argument("--batch", type=int, default=256, help="global batch (default: 256, the Pipe benchmark's largest)")
    parser.add_argument("--node", nargs="+", default=list(NODES), choices=tuple(NODES))
    parser.add_argument("--gpus", type=int, nargs="+", default=[4, 8], help="GPUs in the node (default: 4 8)")
    parser.add_argument("--gpu-mem", type=float, default=None, metavar="GB", help="memory per GPU (default: 80)")
    parser.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                        help="a measured device and network (`pipetrain plan --calibrate`) instead of --node")
    args = parser.parse_args(argv)
    nodes = {name: NODES[name] for name in args.node}
    if args.calibration is not None:
        calib = load_calibration(args.calibration)
        nodes = {args.calibration.stem: (calib.device, calib.network)}
    blocks = config_blocks(PRESETS[args.preset])
    rates = f"the calibration's {calib.precision}" if args.calibration is not None else "fp32 (TF32 matmuls)"
    print(f"preset {args.preset!r}, global batch {args.batch}, {rates}; memory per GPU is the largest "
          f"pipeline rank's{'' if args.gpu_mem is None else f', {args.gpu_mem:g} GB per GPU'}")
    print("| node | GPUs | tp | pp | dp | best layout of the mesh | step s | samples/s | memory GB per GPU | vs best |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for name, (device, network) in nodes.items():
        if args.gpu_mem is not None:
            device = replace(device, memory_bytes=args.gpu_mem * _GB)
        for gpus in args.gpus:
            cells = node_cells(blocks, gpus, args.batch, device, network)
            fastest = min((c.best.step_s for c in cells if c.best), default=None)
            for c in cells:
                if c.best is None:
                    print(f"| {name} | {gpus} | {c.tp} | {c.pp} | {c.dp} | does not fit in "
                          f"{device.memory_bytes / _GB:.0f} GB | - | - | {c.memory_bytes / _GB:.2f} (leanest) | - |")
                    continue
                mark = " **best**" if c.best.step_s == fastest else ""
                print(f"| {name} | {gpus} | {c.tp} | {c.pp} | {c.dp} | {_describe(c.best)} | {c.best.step_s:.3f} | "
                      f"{c.best.samples_per_s:.0f} | {c.memory_bytes / _GB:.2f} | "
                      f"{c.best.step_s / fastest:.2f}x{mark} |")


if __name__ == "__main__":
    main()
