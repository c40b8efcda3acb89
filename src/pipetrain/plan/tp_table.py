"""Where tensor parallelism wins, as the planner predicts it: one GPU node, every tp × pp × dp that fills it.

`python benchmarks/tp_table.py` prints it for a preset of the reference model (the planner itself knows no model:
its caller gives the block costs).

For each node (`hardware.NODES`: stated A100-/H100-class constants) and each (tp, pp, dp) with tp × pp × dp =
the node's GPUs, the fastest layout the planner finds at that mesh (schedule, micro-batches, recomputation,
DDP/FSDP, balance and sequence parallelism searched) with its step time and memory per GPU, or the memory
the leanest one would need when none fits. Pure: no torch, no process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipetrain.errors import ConfigError
from pipetrain.plan.hardware import Device, Network
from pipetrain.plan.model import BlockCost
from pipetrain.plan.predict import Prediction, predict
from pipetrain.plan.search import SearchSpace, enumerate_layouts, search
from pipetrain.plan.tensor import tp_problem

__all__ = ["Cell", "node_cells"]

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


if __name__ == "__main__":  # this module printed the table before 0.2
    raise SystemExit("error: the table moved: run `python benchmarks/tp_table.py` (same options)")
