"""Stage input/output shapes found by running the blocks on the meta device (no memory, no compute)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipetrain.blocks import BlockModel

__all__ = ["boundary_tensors"]


def boundary_tensors(
    model: BlockModel, bounds: Sequence[tuple[int, int]], batch_size: int
) -> list[torch.Tensor]:
    """Meta tensors at every stage boundary for a micro-batch of `batch_size`: stage k reads entry k, writes k+1.

    Giving `PipelineStage` these shapes up front avoids its hidden shape-inference forward on garbage
    inputs (which would move BatchNorm statistics and the dropout RNG).
    """
    with torch.device("meta"):
        blocks = [model.build_block(i).to("meta") for i in range(model.num_blocks)]
        x = model.example_input(batch_size).to("meta")
        boundaries = [x]
        for start, stop in bounds:
            with torch.no_grad():
                for block in blocks[start:stop]:
                    x = block(x)
            boundaries.append(x)
    return boundaries
