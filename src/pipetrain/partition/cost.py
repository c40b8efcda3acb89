"""Per-block costs of a `BlockModel`, and the balance a `PipelineConfig` asks for."""

from __future__ import annotations

import torch

from pipetrain.blocks import BlockModel
from pipetrain.config import PipelineConfig
from pipetrain.partition.solver import solve_balance, uniform_balance

__all__ = ["parameter_costs", "resolve_balance"]


def parameter_costs(model: BlockModel) -> list[int]:
    """The number of parameters of each block, in order.

    Each block is built under `torch.device("meta")`, so parameters get shapes but no storage; a block
    whose `build_block` copies existing tensors (e.g. `ModuleListModel`) may still use memory for the copy.
    Parameters shared inside one block are counted once.
    """
    costs = []
    for index in range(model.num_blocks):
        with torch.device("meta"):
            block = model.build_block(index)
        costs.append(sum(param.numel() for param in block.parameters()))
        del block
    return costs


def resolve_balance(model: BlockModel, pipeline_config: PipelineConfig) -> list[int]:
    """The block count of each of the `pipeline_config.num_stages` stages.

    The explicit `balance` when given; otherwise `uniform` counts, or (`parameters`) the split that
    minimises the largest per-stage parameter count (see `solve_balance` for the tie rules).
    """
    num_blocks = model.num_blocks
    pipeline_config.check_blocks(num_blocks)
    if pipeline_config.balance is not None:
        return list(pipeline_config.balance)
    if pipeline_config.partition == "uniform":
        return uniform_balance(num_blocks, pipeline_config.num_stages)
    return solve_balance(parameter_costs(model), pipeline_config.num_stages)
