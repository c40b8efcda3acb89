"""Where tensor parallelism wins, as the planner predicts it: one GPU node, every tp × pp × dp that fills it.

    PYTHONPATH=src python -m pipetrain.plan.tp_table                     # gpu preset, A100 and H100, 4 and 8 GPUs
    PYTHONPATH=src python -m pipetrain.plan.tp_table --batch 32 --node h100 --gpus 8
    PYTHONPATH=src python -m pipetrain.plan.tp_table --preset cpu --gpus 2 --batch 64 --calibration FILE  # this machine

For each node (`hardware.NODES`: stated A100-/H100-class constants) and each (tp, pp, dp) with tp × pp × dp =
the node's GPUs, the fastest layout the planner finds at that mesh (schedule, micro-batches, recomputation,
DDP/FSDP, balance and sequence parallelism searched) with its step time and memory per GPU, or the memory
the leanest one would need when none fits. Pure: no torch, no process.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipetrain.errors import ConfigError
from pipetrain.plan.hardware import NODES, Device, Network, load_calibration
from pipetrain.plan.model import BlockCost, config_blocks
from pipetrain.plan.predict import Prediction, predict
from pipetrain.plan.search import SearchSpace, enumerate_layouts, search
from pipetrain.plan.tensor import tp_problem
from pipetrain.workloads.presets import PRESETS

__all__ = ["Cell", "node_cells", "main"]

_GB = 2**30


@dataclass(frozen=True)
class Cell:
    """The best layout of one (tp, pp, dp) mesh and its memory per GPU, or (best None) the memory its leanest
    layout would need."""

    tp: int
    pp: int
    dp: int
    best: Prediction | None
    memory_bytes: float


def node_cells(blocks: Sequence[BlockCost], gpus: int, batch: int, device: Device, network: Network,
               space: SearchSpace = SearchSpace(max_chunks=32)) -> list[Cell]:
    """Every (tp, pp, dp) filling a node of `gpus`, each with its fastest fitting layout."""
    cells = []
    for tp in (t for t in (1, 2, 4, 8) if gpus % t == 0 and tp_problem(blocks, t) is None):
        for pp in (p for p in range(1, gpus // tp + 1) if gpus // tp % p == 0 and p <= len(blocks)):
            dp = gpus // tp // pp
            if batch % dp:
                continue
            mesh = replace(space, tps=(tp,), only_pp=pp)
            try:
                best = search(blocks, gpus=gpus, batch=batch, device=device, network=network, space=mesh,
                              gpus_per_node=gpus, top=1).best[0]
                cells.append(Cell(tp, pp, dp, best, max(best.memory_bytes)))
            except ConfigError:  # nothing of this mesh fits
                layouts = enumerate_layouts(len(blocks), gpus, batch, mesh, gpus, [(tp, tp > 1)])
                lean = min(max(predict(blocks, lay, device, network).memory_bytes) for lay in layouts)
                cells.append(Cell(tp, pp, dp, None, lean))
    return cells


def _describe(p: Prediction) -> str:
    lay = p.layout
    schedule = lay.schedule + (f"x{lay.virtual}" if lay.virtual > 1 else "")
    mode = lay.dp_mode if lay.dp > 1 else "-"
    return f"{schedule}, {lay.chunks} chunks, {lay.checkpoint}, {mode}{', sp' if lay.sequence_parallel else ''}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpu", choices=tuple(PRESETS))
    parser.add_argument("--batch", type=int, default=256, help="global batch (default: 256, the seed's largest)")
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
